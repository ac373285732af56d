"""Run the engine's paths once before the worker takes its first job.

A fresh process pays for its first prefill, first decode step, first resumed cache and first block
cut (MLX compiles and caches kernels per shape, the C attention loads, memory is touched for the
first time). Measured after a restart: returning agents' first tokens came ~2x slower than the same
turns a minute later. Paid here, before the worker registers with rq, no job waits behind it.
"""

from __future__ import annotations

import logging
import time

from engine.core.params import SamplingParams
from engine.core.results import Completion
from worker.ports import Engine

log = logging.getLogger("kvrq.worker")

#: Long enough for a full block and a partial one (the shapes real prompts take), short enough to
#: cost a second or two on a CPU.
PROMPT_TOKENS = 300


def warm_up(engine: Engine) -> float:
    """Prefill, decode, cut to blocks, resume from the cut cache beside a fresh row: seconds spent."""
    started = time.perf_counter()
    vocab = max(2, engine.vocab_size or 256)
    prompt = [(17 + 31 * i) % vocab for i in range(PROMPT_TOKENS)]
    params = SamplingParams(max_tokens=4, stop_tokens=())
    first = engine.submit(None, prompt, params, keep_cache=True)
    cache = _run(engine, {first})[first].cache
    resumed = engine.submit(None, [*prompt, *prompt[:24]], params, cache=cache, keep_cache=False)
    fresh = engine.submit(None, prompt[:40], params, keep_cache=False)
    _run(engine, {resumed, fresh})
    spent = time.perf_counter() - started
    log.info("engine warmed up in %.1f s", spent)
    return spent


def _run(engine: Engine, uids: set[int], max_steps: int = 10_000) -> dict[int, Completion]:
    done: dict[int, Completion] = {}
    for _ in range(max_steps):
        if uids <= done.keys():
            return done
        for completion in engine.step().completions:
            done[completion.uid] = completion
    raise RuntimeError(f"the engine did not finish its warm-up rows in {max_steps} steps")
