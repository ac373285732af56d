"""Worker benchmarks: the whole path (producer -> Redis -> kvrq worker -> stream/result) against raw mlx-lm.

    python benchmarks/bench_worker.py            # full run, writes benchmarks/results/worker.json
    python benchmarks/bench_worker.py --quick    # fewer tokens and repeats (a smoke run)

1. Throughput: 16 chat jobs at once through Redis + one worker, vs the same prompts in one raw
   mlx-lm BatchGenerator in this process (target ratio >= 0.9), vs mlx_lm.generate one by one.
2. Queue overhead: enqueue -> first token read by the client, minus the engine's own time to first
   token, for max_tokens=1 jobs on an idle worker (target p50 < 10 ms).
3. Warm vs cold agent at ~1K and ~2K tokens of history: the same request for an agent whose cache
   holds the conversation so far, and for a fresh agent; enqueue -> first token at the client.
   Run against a worker with its in-memory hot tier, and one reading caches from disk.
4. Floor (`--only floor`): at 512 / 1K / 2K / 4K / 8K tokens of history, the warm-resume speedup
   through the whole worker path (cold = the same turn as a job with no agent) as a fraction of
   raw mlx-lm's own in the same run (cold = prefill in 512-token steps to the first token; warm =
   `load_prompt_cache` of the history from a file + the new tokens).
5. Warm join (`--warm-join`): an agent with ~1K / ~2K tokens of history (its cache in the worker's hot
   tier) joins 8 decoding sequences; client submit -> first streamed token, split by the worker's
   timeline of the job (worker/loop/timeline.py) into enqueue / queue / take / cache load / submit / to step
   / step / publish, in ms and in the batch mates' step time measured in the same round; and the mates'
   step that carried the joiner's suffix, and those after, against their steps before.
6. Short behind long (`--only long_prefill`): a new agent's cold 200-token turn arriving while another
   agent's cold 8K-token prompt is being prefilled (one sequence decoding beside them): client submit
   -> first streamed token in that prefill's steps (issue 42: within 3), split as the warm join's.

Everything runs on this machine, in one run: a private redis-server, worker subprocesses
(`kvrq worker`, OpenBLAS preloaded like this process), this process idle while they work.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import NAN, percentile  # noqa: E402
from engine.cpu.blas import ensure_fast_blas, openblas_loaded  # noqa: E402

QUESTIONS = [
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Write a haiku about the sea.",
    "What is 17 times 3?",
    "Name three primary colors.",
    "Why is the sky blue?",
    "Give me a tip for learning to cook.",
    "What does a compiler do?",
    "Describe a cat to someone who has never seen one.",
    "What is the boiling point of water at sea level?",
    "Suggest a name for a small bakery.",
    "How do bees make honey?",
    "What is the tallest mountain on Earth?",
    "Summarize the plot of Cinderella.",
    "What are the benefits of walking every day?",
    "How does a rainbow form?",
]
BRIEFING = (
    "The Lighthouse Project keeps a fleet of eleven research boats along a rocky northern coast. "
    "Each boat is named after a seabird. The fleet measures water temperature, salinity and plankton "
    "every morning at dawn and sends its readings to a station on the harbour wall, run by Ada, Bram "
    "and Chidi. In winter only four boats sail, because storms close the outer channel for weeks. "
    "The oldest boat was built in 1978. "
)


def chat(question: str, system: str = "You are a helpful assistant.") -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


# ---- in-process baselines -----------------------------------------------------------------


def raw_batch_generator(
    model: Any, tokenizer: Any, prompts: list[list[int]], max_tokens: int
) -> dict[str, Any]:
    from mlx_lm.generate import BatchGenerator, StopSequences

    eos = sorted(int(t) for t in tokenizer.eos_token_ids)
    generator = BatchGenerator(model, completion_batch_size=16, prefill_batch_size=8, prefill_step_size=512)
    started = time.perf_counter()
    uids = generator.insert(
        prompts,
        max_tokens=[max_tokens] * len(prompts),
        stop_sequences=[StopSequences([[t] for t in eos]) for _ in prompts],
    )
    tokens: dict[int, list[int]] = {uid: [] for uid in uids}
    done: set[int] = set()
    while len(done) < len(uids):
        _, responses = generator.next()
        for response in responses:
            token = int(response.token)
            if not (response.finish_reason == "stop" and token in eos):
                tokens[response.uid].append(token)
            if response.finish_reason is not None:
                done.add(response.uid)
    elapsed = time.perf_counter() - started
    generator.close()
    generated = sum(len(t) for t in tokens.values())
    texts = [tokenizer.decode(tokens[uid]) for uid in uids]
    return {
        "seconds": elapsed,
        "generated_tokens": generated,
        "tokens_per_s": generated / elapsed,
        "texts": texts,
    }


def sequential_generate(
    model: Any, tokenizer: Any, prompts: list[list[int]], max_tokens: int
) -> dict[str, Any]:
    from mlx_lm import stream_generate

    generated = 0
    started = time.perf_counter()
    for prompt in prompts:
        responses = list(stream_generate(model, tokenizer, prompt, max_tokens=max_tokens))
        generated += responses[-1].generation_tokens if responses else 0
    elapsed = time.perf_counter() - started
    return {"seconds": elapsed, "generated_tokens": generated, "tokens_per_s": generated / elapsed}


# ---- through Redis and a worker -----------------------------------------------------------


def through_worker(producer: Any, requests: list[dict[str, Any]]) -> dict[str, Any]:
    started = time.perf_counter()
    handles = producer.submit_many(requests)
    results = [h.result(timeout=1800) for h in handles]
    elapsed = time.perf_counter() - started
    generated = sum(r.usage.generated_tokens for r in results)
    return {
        "seconds": elapsed,
        "generated_tokens": generated,
        "tokens_per_s": generated / elapsed,
        "texts": [r.text for r in results],
    }


def first_token(producer: Any, request: dict[str, Any]) -> tuple[float, Any]:
    """Seconds from enqueue to the first streamed token at this client, and the job's result."""
    started = time.perf_counter()
    handle = producer.submit(request)
    for event in handle.events(timeout=600):
        if event.kind == "delta":
            break
    elapsed = time.perf_counter() - started
    return elapsed, handle.result(timeout=600)


def queue_overhead(producer: Any, repeats: int) -> dict[str, Any]:
    request = {"messages": chat("Hi"), "max_tokens": 1}
    first_token(producer, request)  # warm-up
    totals, overheads = [], []
    for _ in range(repeats):
        total, result = first_token(producer, request)
        engine = result.timings.engine_time_to_first_token_s or 0.0
        totals.append(total)
        overheads.append(total - engine)
    return {
        "repeats": repeats,
        "enqueue_to_first_token_ms": {
            "p50": 1000 * percentile(totals, 0.5, NAN),
            "p95": 1000 * percentile(totals, 0.95, NAN),
        },
        "overhead_ms": {
            "p50": 1000 * percentile(overheads, 0.5, NAN),
            "p95": 1000 * percentile(overheads, 0.95, NAN),
        },
    }


def history_for(tokenizer: Any, target_tokens: int, lead: str = "") -> list[dict[str, str]]:
    """A system briefing long enough that the conversation is about `target_tokens` tokens; a `lead`
    of its own makes it share no prefix with any other."""
    system = lead + "You answer questions about these notes. " + BRIEFING
    while (
        len(tokenizer.apply_chat_template(chat("q", system), add_generation_prompt=True)) < target_tokens - 60
    ):
        system += BRIEFING
    return chat("How many boats are in the fleet?", system)


def first_turn(
    producer: Any, tokenizer: Any, target_tokens: int, settle_s: float
) -> tuple[str, list[dict[str, str]]]:
    """A new agent's first turn (about `target_tokens` tokens), run: its id and its next turn's messages
    but the user's question."""
    agent = f"bench-{uuid.uuid4().hex[:8]}"
    turn1 = history_for(tokenizer, target_tokens)
    first = producer.submit({"agent_id": agent, "messages": turn1, "max_tokens": 16}).result(timeout=600)
    time.sleep(settle_s)
    return agent, [*turn1, {"role": "assistant", "content": first.text}]


def asking(messages: list[dict[str, str]], question: str) -> list[dict[str, str]]:
    return [*messages, {"role": "user", "content": question}]


def warm_vs_cold(
    producer: Any, tokenizer: Any, target_tokens: int, repeats: int, settle_s: float = 0.0
) -> tuple[dict[str, Any], list[dict[str, str]]]:
    """The figures, and the last turn 2's messages (the floor replays them on raw mlx-lm).

    `settle_s` after turn 1 lets the store's write-behind reach the backend (a store read, not memory)."""
    warm, cold, loads, prompt_sizes, reused, warm_engine, cold_engine = [], [], [], [], [], [], []
    for _ in range(repeats):
        agent, so_far = first_turn(producer, tokenizer, target_tokens, settle_s)
        turn2 = asking(so_far, "And in winter?")
        warm_s, warm_result = first_token(producer, {"agent_id": agent, "messages": turn2, "max_tokens": 1})
        # Cold: the same prompt with no agent, so no store (another agent's shared prefix blocks would
        # otherwise warm-start a fresh agent).
        cold_s, cold_result = first_token(producer, {"messages": turn2, "max_tokens": 1})
        assert cold_result.usage.reused_tokens == 0
        warm.append(warm_s)
        cold.append(cold_s)
        loads.append(warm_result.timings.cache_load_s)
        warm_engine.append(warm_result.timings.engine_time_to_first_token_s or 0.0)
        cold_engine.append(cold_result.timings.engine_time_to_first_token_s or 0.0)
        prompt_sizes.append(warm_result.usage.prompt_tokens)
        reused.append(warm_result.usage.reused_tokens)
    cold_median, warm_median = statistics.median(cold), statistics.median(warm)
    return {
        "prompt_tokens": int(statistics.median(prompt_sizes)),
        "reused_tokens": int(statistics.median(reused)),
        "cold_first_token_s": cold_median,
        "warm_first_token_s": warm_median,
        "warm_cache_load_s": statistics.median(loads),
        "warm_engine_first_token_s": statistics.median(warm_engine),
        "cold_engine_first_token_s": statistics.median(cold_engine),
        "speedup": cold_median / warm_median,
        "repeats": repeats,
    }, turn2


def raw_floor(model: Any, prompt: list[int], cached: int, workdir: Path, repeats: int) -> dict[str, float]:
    """Raw mlx-lm's warm-resume speedup for `prompt` whose first `cached` tokens were seen before:
    cold prefill (512-token steps, as mlx-lm generates) vs load_prompt_cache + the rest, best of repeats."""
    from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

    from benchmarks.bench_store import first_token_direct

    path = workdir / "floor.safetensors"
    layers = make_prompt_cache(model)
    first_token_direct(model, layers, prompt[: cached + 1])  # fills the cache with `cached` + 1 tokens
    for layer in layers:
        layer.trim(1)
    save_prompt_cache(str(path), layers)
    cold, warm, firsts = [], [], set()
    for _ in range(repeats):
        started = time.perf_counter()
        firsts.add(first_token_direct(model, make_prompt_cache(model), prompt))
        cold.append(time.perf_counter() - started)
        started = time.perf_counter()
        firsts.add(first_token_direct(model, load_prompt_cache(str(path)), prompt[cached:]))
        warm.append(time.perf_counter() - started)
    assert len(firsts) == 1, "raw warm and cold first tokens differ"
    return {"raw_cold_s": min(cold), "raw_warm_s": min(warm), "raw_speedup": min(cold) / min(warm)}


def floor(
    producer: Any, model: Any, tokenizer: Any, workdir: Path, contexts: tuple[int, ...]
) -> dict[int, dict[str, Any]]:
    from producer.models import GenerationRequest
    from worker.requests.prompts import prompt_tokens

    rows = {}
    context = int(getattr(model.args, "max_position_embeddings", 8192))
    for n in contexts:
        repeats = 3 if n <= 2048 else 1
        print(f"floor {n} ...", flush=True)
        # history_for overshoots by up to one briefing (~100 tokens): keep turn 1 inside the context
        # settle: turn 2 comes once turn 1's cache is written (a 377 MB write at 8K), as raw's file is
        through, turn2 = warm_vs_cold(producer, tokenizer, min(n, context - 250), repeats, settle_s=n / 1024)
        tokens = prompt_tokens(tokenizer, GenerationRequest.model_validate({"messages": turn2}))
        raw = raw_floor(model, tokens, through["reused_tokens"], workdir, repeats)
        rows[n] = {**through, **raw, "vs_floor": through["speedup"] / raw["raw_speedup"]}
        print(rows[n], flush=True)
    return rows


# ---- a warm agent joining a busy batch ------------------------------------------------------

MATES = 8
#: client submit -> in Redis (rq's enqueued_at) -> dequeued by the worker -> parsed, tokenized, started
#: in rq -> turn taken, cache read -> engine.submit() returned -> the next step began -> that step
#: returned the first token -> the client read it (worker/loop/timeline.py).
JOIN_SPLIT = ("enqueue", "queue", "take", "cache load", "submit", "to step", "step", "publish")


class Mate:
    """A batch mate: a long greedy job (EOS banned) whose delta arrival times a thread records."""

    def __init__(self, producer: Any, question: str, eos: list[int], max_tokens: int) -> None:
        import threading

        bias = {str(t): -100.0 for t in eos}
        self.handle = producer.submit(
            {"messages": chat(question), "max_tokens": max_tokens, "logit_bias": bias}
        )
        self.arrivals: list[float] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for event in self.handle.events(timeout=600):
            if event.kind == "delta":
                self.arrivals.append(time.time())


def step_gaps(mates: list[Mate], start: float, end: float) -> list[float]:
    """The batch's steps in [start, end): the gaps between one mate's deltas (one per step; every
    mate's delta of a step comes in the same publish)."""
    gaps: list[float] = []
    reference = mates[0].arrivals
    for i in range(1, len(reference)):
        if start <= reference[i - 1] and reference[i] < end:
            gaps.append(reference[i] - reference[i - 1])
    return gaps


def gap_ending_at(mates: list[Mate], moment: float) -> float:
    """The batch mates' step whose deltas were published with the joiner's first token (median over mates)."""
    gaps = []
    for mate in mates:
        times = mate.arrivals
        nearest = min(range(1, len(times)), key=lambda i: abs(times[i] - moment))
        gaps.append(times[nearest] - times[nearest - 1])
    return statistics.median(gaps)


#: One per join of an agent, each from its first word new to the agent's cache (a suffix of 12-16 tokens).
JOIN_QUESTIONS = (
    "And in winter?",
    "Who runs the station?",
    "What do the boats measure?",
    "When was the oldest boat built?",
    "Where do the readings go?",
)


def split_of(timeline: dict[str, Any], submitted: float, first_token: float) -> dict[str, float]:
    """Client submit -> first streamed token cut at the job's timeline marks (JOIN_SPLIT), in seconds."""
    marks = [submitted] + [
        timeline[k]
        for k in ("enqueued", "dequeued", "held", "cache_ready", "admitted", "step_started", "first_token")
    ]
    return {name: b - a for name, a, b in zip(JOIN_SPLIT, marks, [*marks[1:], first_token], strict=True)}


def warm_join_once(
    producer: Any, tokenizer: Any, agent: str, turn2: list[dict[str, str]], seed: int, settle_s: float
) -> dict[str, Any]:
    """The agent's turn `turn2` joining MATES decoding sequences; `settle_s` before it lets a worker
    without a hot tier write the agent's cache first."""
    import random

    rng = random.Random(seed)
    eos = sorted(int(t) for t in tokenizer.eos_token_ids)
    time.sleep(settle_s)
    mates = [Mate(producer, QUESTIONS[i], eos, 72) for i in range(MATES)]
    while min(len(m.arrivals) for m in mates) < 16:  # all eight decoding, past their own prefill
        time.sleep(0.01)
    before_start = mates[0].arrivals[6]  # steady decoding from here until the join
    recent = step_gaps(mates, before_start, time.time())
    time.sleep(rng.uniform(0.0, statistics.median(recent)))  # arrive at a random point of a step
    submitted = time.time()
    handle = producer.submit({"agent_id": agent, "messages": turn2, "max_tokens": 4})
    for event in handle.events(timeout=600):
        if event.kind == "delta":
            break
    first_token = time.time()
    result = handle.result(timeout=600)
    for mate in mates:
        mate.handle.result(timeout=600)
        mate.thread.join(timeout=10)
    busy = statistics.median(step_gaps(mates, before_start, submitted))
    joined = gap_ending_at(mates, first_token)
    after = statistics.median(step_gaps(mates, first_token + 0.001, first_token + 8 * busy))
    timeline = handle.meta().get("progress", {}).get("timeline", {})
    split_s = split_of(timeline, submitted, first_token)
    return {
        "prompt_tokens": result.usage.prompt_tokens,
        "reused_tokens": result.usage.reused_tokens,
        "first_token_s": first_token - submitted,
        "busy_step_s": busy,
        "join_step_s": joined,
        # CPU seconds of the worker's step that gave the first token / the step before it (all threads)
        "join_step_cpu_ratio": timeline["step_cpu"] / timeline["step_before_cpu"],
        "after_step_s": after,
        "split_s": split_s,
        "steps": {
            "dequeued": timeline["dequeued_step"],
            "cache_ready": timeline["cache_ready_step"],
            "admitted": timeline["admitted_step"],
            "first_token": timeline["first_token_step"],
        },
    }


def warm_join(
    producer: Any, tokenizer: Any, contexts: tuple[int, ...], repeats: int, settle_s: float = 0.0
) -> dict[int, Any]:
    """A warm agent joining MATES decoding sequences: client submit -> first streamed token, and where
    it went (worker/loop/timeline.py), in the batch mates' step times measured in the same round."""
    rows: dict[int, Any] = {}
    for n in contexts:
        runs = []
        agent, so_far = first_turn(producer, tokenizer, n, settle_s)
        for r in range(repeats):
            question = JOIN_QUESTIONS[r % len(JOIN_QUESTIONS)]
            run = warm_join_once(producer, tokenizer, agent, asking(so_far, question), r, settle_s)
            steps = run["busy_step_s"]
            print(
                f"join {n}: {run['prompt_tokens']} tokens ({run['reused_tokens']} reused): "
                f"{1000 * run['first_token_s']:.0f} ms = {run['first_token_s'] / steps:.2f} steps of "
                f"{1000 * steps:.0f} ms (CPU: join step {run['join_step_cpu_ratio']:.2f}x the one before); "
                + ", ".join(f"{k} {1000 * v:.0f} ms" for k, v in run["split_s"].items())
                + f"; engine steps {run['steps']}; join step {run['join_step_s'] / steps:.2f}x, "
                f"after {run['after_step_s'] / steps:.2f}x",
                flush=True,
            )
            runs.append(run)
        rows[n] = summarize_joins(runs)
    return rows


def summarize_joins(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the runs; each run's times in its own busy steps first."""

    def med(values: list[float]) -> float:
        return statistics.median(values)

    return {
        "runs": len(runs),
        "prompt_tokens": runs[0]["prompt_tokens"],
        "reused_tokens": runs[0]["reused_tokens"],
        "busy_step_ms": 1000 * med([r["busy_step_s"] for r in runs]),
        "first_token_ms": 1000 * med([r["first_token_s"] for r in runs]),
        "first_token_steps": med([r["first_token_s"] / r["busy_step_s"] for r in runs]),
        "split_ms": {k: 1000 * med([r["split_s"][k] for r in runs]) for k in JOIN_SPLIT},
        "split_steps": {k: med([r["split_s"][k] / r["busy_step_s"] for r in runs]) for k in JOIN_SPLIT},
        "join_step_ratio": med([r["join_step_s"] / r["busy_step_s"] for r in runs]),
        "join_step_cpu_ratio": med([r["join_step_cpu_ratio"] for r in runs]),
        "after_step_ratio": med([r["after_step_s"] / r["busy_step_s"] for r in runs]),
        "engine_steps_dequeue_to_first_token": med(
            [r["steps"]["first_token"] - r["steps"]["dequeued"] for r in runs]
        ),
        "all_first_token_steps": [round(r["first_token_s"] / r["busy_step_s"], 2) for r in runs],
    }


def print_joins(report: dict[str, Any]) -> None:
    """Times in ms, and in the batch mates' busy steps in brackets."""
    print(
        f"\n| store | history | prompt / reused | busy step | first token | in steps | "
        f"{' | '.join(JOIN_SPLIT)} | join step | join step CPU | after |"
    )
    print("|---|---|---|---|---|---|" + "---|" * len(JOIN_SPLIT) + "---|---|---|")
    for store, rows in report["warm_join"].items():
        for n, row in rows.items():
            split = " | ".join(f"{row['split_ms'][k]:.0f} ({row['split_steps'][k]:.2f})" for k in JOIN_SPLIT)
            print(
                f"| {store} | {n} | {row['prompt_tokens']} / {row['reused_tokens']} "
                f"| {row['busy_step_ms']:.0f} ms "
                f"| {row['first_token_ms']:.0f} ms | {row['first_token_steps']:.2f} | {split} "
                f"| {row['join_step_ratio']:.2f}x | {row['join_step_cpu_ratio']:.2f}x "
                f"| {row['after_step_ratio']:.2f}x |"
            )


def join_step_cost(contexts: tuple[int, ...], suffixes: tuple[int, ...], rounds: int) -> dict[str, Any]:
    """The engine's share of a join, in this process (no worker): 8 rows decoding, then an agent with
    n cached tokens and a suffix of s tokens joins; the CPU seconds (all threads: a loaded machine
    blurs them less than wall time) of the step carrying the suffix, of the submit before it, and of
    the step after, against the busy step just before, per (n, s). The batch's flat batch runs as 16
    rows up to 16 tokens and 32 from 20 (engine/cpu/gemm_rows.py): 8 decoding rows leave room for 8
    suffix tokens in a busy step's shape."""
    from benchmarks.bench_engine import _NoEos, short_prompts, synthetic_cache_for
    from engine.batch.engine import BlockPoolBatchEngine
    from engine.core.params import SamplingParams
    from engine.models.load import load_model

    model, tokenizer = load_model("smollm2-135m")
    engine = BlockPoolBatchEngine(model, _NoEos(tokenizer), model_name="smollm2-135m", pool_mb=3000)
    for prompt in short_prompts(tokenizer, MATES):
        engine.submit(None, prompt, SamplingParams(max_tokens=4000))
    while len(engine.step().deltas) < MATES:
        pass

    def cpu(fn: Any) -> tuple[float, Any]:
        started = time.process_time()
        value = fn()
        return time.process_time() - started, value

    rows: dict[str, Any] = {}
    for n in contexts:
        cache = synthetic_cache_for(model, n, 0)
        for suffix in suffixes:
            runs = []
            for _ in range(rounds):
                busy, _ = cpu(engine.step)
                prompt = cache.token_ids + list(range(100, 100 + suffix))
                submit, uid = cpu(
                    lambda p=prompt, c=cache: engine.submit("a", p, SamplingParams(max_tokens=4), cache=c)
                )
                join, output = cpu(engine.step)
                assert uid in {d.uid for d in output.deltas}, "the first token came with the join step"
                after, _ = cpu(engine.step)
                engine.cancel(uid)
                runs.append((submit / busy, join / busy, after / busy))
            rows[f"{n}+{suffix}"] = {
                "submit": statistics.median(r[0] for r in runs),
                "join_step": statistics.median(r[1] for r in runs),
                "step_after": statistics.median(r[2] for r in runs),
                "rounds": rounds,
            }
            print(f"join step cost {n}+{suffix}: {rows[f'{n}+{suffix}']}", flush=True)
    engine.close()
    return rows


def short_behind_long_once(
    producer: Any, tokenizer: Any, long_tokens: int, short_tokens: int, seed: int
) -> dict[str, Any]:
    """A cold `short_tokens` turn of a new agent arriving (at a random point of a step) while another
    agent's cold `long_tokens` prompt is being prefilled, one sequence decoding beside them: client
    submit -> first streamed token, in the steps of that prefill (the decoding mate's gaps between
    the long job's admission and the short one's submit). Both are canceled once measured."""
    import random

    rng = random.Random(seed)
    eos = sorted(int(t) for t in tokenizer.eos_token_ids)
    mate = Mate(producer, QUESTIONS[seed % len(QUESTIONS)], eos, 1000)
    while len(mate.arrivals) < 8:
        time.sleep(0.01)
    nonce = uuid.uuid4().hex[:8]
    long_messages = history_for(tokenizer, long_tokens, lead=f"Long notes {nonce}. ")
    long_job = producer.submit({"agent_id": f"long-{nonce}", "messages": long_messages, "max_tokens": 4})
    while long_job.meta().get("progress", {}).get("phase") != "running":
        time.sleep(0.01)
    admitted = time.time()
    while sum(1 for t in mate.arrivals if t > admitted) < 3:  # two whole steps of the prefill seen
        time.sleep(0.01)
    busy = statistics.median(step_gaps([mate], admitted, time.time()))
    time.sleep(rng.uniform(0.0, busy))
    short_messages = history_for(tokenizer, short_tokens, lead=f"Short notes {nonce}. ")
    submitted = time.time()
    short = producer.submit({"agent_id": f"short-{nonce}", "messages": short_messages, "max_tokens": 4})
    for event in short.events(timeout=600):
        if event.kind == "delta":
            break
    first_token = time.time()
    result = short.result(timeout=600)
    long_prefilling = long_job.meta().get("progress", {}).get("generated_tokens", 0) == 0
    long_job.cancel()
    mate.handle.cancel()
    mate.thread.join(timeout=60)
    timeline = short.meta().get("progress", {}).get("timeline", {})
    split_s = split_of(timeline, submitted, first_token)
    return {
        "prompt_tokens": result.usage.prompt_tokens,
        "long_prompt_tokens": len(tokenizer.apply_chat_template(long_messages, add_generation_prompt=True)),
        "long_still_prefilling": long_prefilling,  # the short one's first token came during the prefill
        "first_token_s": first_token - submitted,
        "busy_step_s": busy,
        "first_token_steps": (first_token - submitted) / busy,
        "split_steps": {k: v / busy for k, v in split_s.items()},
        "engine_steps_dequeue_to_first_token": timeline["first_token_step"] - timeline["dequeued_step"],
    }


def short_behind_long(producer: Any, tokenizer: Any, repeats: int) -> dict[str, Any]:
    """Issue 42's rule: a 200-token turn arriving while an 8K-token prompt is prefilled gets its first
    token within 3 busy steps."""
    runs = []
    for r in range(repeats):
        run = short_behind_long_once(producer, tokenizer, 8000, 200, r)
        print(
            f"short behind long: {run['prompt_tokens']} tokens behind {run['long_prompt_tokens']}: "
            f"{1000 * run['first_token_s']:.0f} ms = {run['first_token_steps']:.2f} steps of "
            f"{1000 * run['busy_step_s']:.0f} ms; engine steps dequeue -> first token "
            f"{run['engine_steps_dequeue_to_first_token']}; "
            f"long still prefilling: {run['long_still_prefilling']}; "
            + ", ".join(f"{k} {v:.2f}" for k, v in run["split_steps"].items()),
            flush=True,
        )
        runs.append(run)
    return {
        "runs": runs,
        "first_token_steps_median": statistics.median(r["first_token_steps"] for r in runs),
        "first_token_steps_max": max(r["first_token_steps"] for r in runs),
    }


PARTS = ("throughput", "overhead", "warm", "floor", "join", "join_cost", "long_prefill")


def main() -> int:
    ensure_fast_blas(sys.argv)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer tokens and repeats")
    parser.add_argument(
        "--only",
        choices=PARTS,
        action="append",
        help="run only these parts (repeat); the others keep their figures from the existing JSON",
    )
    parser.add_argument(
        "--warm-join", action="store_true", help="only the warm join into 8 busy sequences (= --only join)"
    )
    parser.add_argument("--join-repeats", type=int, default=5, help="warm joins per history size")
    parser.add_argument(
        "--join-stores", default="hot_tier,disk", help="where the joiner's cache comes from: hot_tier, disk"
    )
    parser.add_argument(
        "--floor-contexts", default="512,1024,2048,4096,8192", help="history sizes of the floor part"
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "worker.json"))
    args = parser.parse_args()
    parts = {"join"} if args.warm_join else set(args.only or PARTS)
    if "join_cost" in parts:
        report_path = Path(args.out)
        saved: dict[str, Any] = json.loads(report_path.read_text()) if report_path.exists() else {}
        saved["join_step_cost"] = {
            "load_average_at_start": os.getloadavg(),
            "rows": join_step_cost((1024, 2048), (1, 8, 16, 24), 3 if args.quick else 5),
            "load_average_at_end": os.getloadavg(),
        }
        report_path.write_text(json.dumps(saved, indent=2) + "\n")
        parts.discard("join_cost")
        if not parts:
            return 0
    max_tokens = 24 if args.quick else 64
    repeats = 10 if args.quick else 40
    warm_repeats = 1 if args.quick else 3
    rounds = 1 if args.quick else 3

    from engine.models.load import load_model
    from producer.client import Producer
    from producer.models import GenerationRequest
    from worker.cli.spawn import redis_server, worker_process
    from worker.requests.prompts import prompt_tokens

    model, tokenizer = load_model("smollm2-135m")
    requests = [{"messages": chat(q), "max_tokens": max_tokens} for q in QUESTIONS]
    prompts = [prompt_tokens(tokenizer, GenerationRequest.model_validate(r)) for r in requests]
    out = Path(args.out)
    keep = args.only or args.warm_join
    report: dict[str, Any] = json.loads(out.read_text()) if out.exists() and keep else {}
    report["machine"] = {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "openblas_preloaded": openblas_loaded(),
        "load_average_at_start": os.getloadavg(),
    }
    report["model"] = "smollm2-135m (float32 on CPU)"

    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvrq-bench-")))
        url = stack.enter_context(redis_server(workdir))
        producer = stack.enter_context(Producer(url))
        env = dict(os.environ)
        print("worker (hot tier on) ...", flush=True)
        with worker_process(url, store=f"disk:{workdir / 'cache'}", env=env):
            through_worker(producer, requests[:2])  # warm-up
            if "throughput" in parts:
                report["throughput"] = throughput(
                    model, tokenizer, producer, requests, prompts, max_tokens, rounds
                )
            if "overhead" in parts:
                print("queue overhead ...", flush=True)
                report["queue_overhead"] = queue_overhead(producer, repeats)
            if "warm" in parts:
                print("warm vs cold ...", flush=True)
                hot = {n: warm_vs_cold(producer, tokenizer, n, warm_repeats)[0] for n in (1024, 2048)}
            joins: dict[str, Any] = {}
            join_stores = args.join_stores.split(",")
            if "join" in parts and "hot_tier" in join_stores:
                print("warm join into 8 busy sequences (hot tier) ...", flush=True)
                joins["hot_tier"] = warm_join(producer, tokenizer, (1024, 2048), args.join_repeats)
            if "long_prefill" in parts:
                print("a 200-token turn behind an 8K-token prefill ...", flush=True)
                report["short_behind_long"] = short_behind_long(producer, tokenizer, args.join_repeats)
            if "floor" in parts:
                contexts = tuple(int(n) for n in args.floor_contexts.split(","))
                report["floor"] = floor(producer, model, tokenizer, workdir, contexts)
        if "warm" in parts:
            print("worker (hot tier off: caches read from disk) ...", flush=True)
            disk_env = {**env, "KVRQ_STORE_HOT_MB": "0"}
            with worker_process(url, store=f"disk:{workdir / 'cache-disk'}", env=disk_env):
                through_worker(producer, requests[:1])  # warm-up
                disk = {
                    n: warm_vs_cold(producer, tokenizer, n, warm_repeats, settle_s=2.0)[0]
                    for n in (1024, 2048)
                }
            print("worker (hot tier off: caches read from the Redis store) ...", flush=True)
            with worker_process(url, store="redis", env=disk_env):
                through_worker(producer, requests[:1])  # warm-up
                from_redis = {
                    n: warm_vs_cold(producer, tokenizer, n, warm_repeats, settle_s=2.0)[0]
                    for n in (1024, 2048)
                }
            report["warm_vs_cold"] = {"hot_tier": hot, "disk": disk, "redis": from_redis}
        if "join" in parts and "disk" in join_stores:
            print("warm join into 8 busy sequences (hot tier off: caches read from disk) ...", flush=True)
            disk_env = {**env, "KVRQ_STORE_HOT_MB": "0"}
            with worker_process(url, store=f"disk:{workdir / 'cache-join'}", env=disk_env):
                through_worker(producer, requests[:2])  # warm-up
                joins["disk"] = warm_join(producer, tokenizer, (1024, 2048), args.join_repeats, settle_s=2.0)
        if joins:
            report["warm_join"] = joins
    if "throughput" in parts:
        print("sequential mlx_lm.generate ...", flush=True)
        sequential = sequential_generate(model, tokenizer, prompts, max_tokens)
        t = report["throughput"]
        t["sequential_generate"] = sequential
        t["worker_vs_sequential_speedup"] = t["worker"]["tokens_per_s"] / sequential["tokens_per_s"]
    report["machine"]["load_average_at_end"] = os.getloadavg()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print_table(report)
    print(f"\nwrote {out}")
    return 0


def throughput(
    model: Any,
    tokenizer: Any,
    producer: Any,
    requests: list[dict[str, Any]],
    prompts: list[list[int]],
    max_tokens: int,
    rounds: int,
) -> dict[str, Any]:
    """The machine is shared: alternate the two paths and keep each one's best run."""
    raw_batch_generator(model, tokenizer, prompts[:2], 4)  # warm-up
    raws, workers = [], []
    for round_ in range(rounds):
        print(f"throughput round {round_ + 1}/{rounds}: raw BatchGenerator, then worker", flush=True)
        raws.append(raw_batch_generator(model, tokenizer, prompts, max_tokens))
        workers.append(through_worker(producer, requests))
    raw = max(raws, key=lambda r: r["tokens_per_s"])
    worker = max(workers, key=lambda r: r["tokens_per_s"])
    same = sum(a == b for a, b in zip(raw["texts"], worker["texts"], strict=True))
    for run in (*raws, *workers):
        run.pop("texts", None)
    return {
        "jobs": len(requests),
        "max_tokens": max_tokens,
        "rounds": rounds,
        "all_runs_tokens_per_s": {
            "raw_batch_generator": [round(r["tokens_per_s"], 1) for r in raws],
            "worker": [round(r["tokens_per_s"], 1) for r in workers],
        },
        "raw_batch_generator": raw,
        "worker": worker,
        "worker_vs_raw_ratio": worker["tokens_per_s"] / raw["tokens_per_s"],
        "identical_texts": f"{same}/{len(requests)}",
    }


def print_table(report: dict[str, Any]) -> None:
    if "throughput" in report and "queue_overhead" in report:
        print_throughput(report)
    if "warm_vs_cold" in report:
        print_warm(report)
    if "floor" in report:
        print_floor(report)
    if "warm_join" in report:
        print_joins(report)
    if "short_behind_long" in report:
        row = report["short_behind_long"]
        steps = ", ".join(f"{r['first_token_steps']:.2f}" for r in row["runs"])
        print(f"\n200-token turn behind an 8K prefill: first token in {steps} busy steps")


def print_throughput(report: dict[str, Any]) -> None:
    t = report["throughput"]
    print(
        f"\n{t['jobs']} concurrent jobs, {t['max_tokens']} max tokens, {report['machine']['cpus']} CPUs, "
        f"best of {t['rounds']} alternating rounds"
    )
    print("| path | generated tokens | seconds | tokens/s |")
    print("|---|---|---|---|")
    for name, key in (
        ("Redis + kvrq worker", "worker"),
        ("raw mlx-lm BatchGenerator", "raw_batch_generator"),
        ("sequential mlx_lm.generate", "sequential_generate"),
    ):
        row = t[key]
        print(f"| {name} | {row['generated_tokens']} | {row['seconds']:.2f} | {row['tokens_per_s']:.1f} |")
    print(
        f"worker / raw = {t['worker_vs_raw_ratio']:.2f}; worker / sequential = "
        f"{t['worker_vs_sequential_speedup']:.1f}x; identical texts {t['identical_texts']}"
    )
    q = report["queue_overhead"]
    print(
        f"\nqueue overhead (max_tokens=1, {q['repeats']} jobs; enqueue to first token at the client, "
        f"minus the engine's submit-to-first-token): p50 {q['overhead_ms']['p50']:.1f} ms, "
        f"p95 {q['overhead_ms']['p95']:.1f} ms (enqueue to first token p50 "
        f"{q['enqueue_to_first_token_ms']['p50']:.1f} ms)"
    )


def print_floor(report: dict[str, Any]) -> None:
    print(
        "\n| history | prompt tokens | reused | worker cold | worker warm | worker speedup "
        "| raw cold | raw warm | raw speedup (floor) | worker / floor |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n, row in report["floor"].items():
        print(
            f"| {n} | {row['prompt_tokens']} | {row['reused_tokens']} | {row['cold_first_token_s']:.2f} s "
            f"| {row['warm_first_token_s']:.3f} s | {row['speedup']:.1f}x | {row['raw_cold_s']:.2f} s "
            f"| {row['raw_warm_s']:.3f} s | {row['raw_speedup']:.1f}x | {row['vs_floor']:.2f} |"
        )


def print_warm(report: dict[str, Any]) -> None:
    print(
        "\n| history | store | prompt tokens | reused | cold first token | warm first token | speedup "
        "| warm: cache load / engine |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for store, rows in report["warm_vs_cold"].items():
        for n, row in rows.items():
            print(
                f"| {n} | {store} | {row['prompt_tokens']} | {row['reused_tokens']} | "
                f"{row['cold_first_token_s']:.2f} s | {row['warm_first_token_s']:.3f} s | "
                f"{row['speedup']:.1f}x | "
                f"{row['warm_cache_load_s']:.3f} s / {row['warm_engine_first_token_s']:.3f} s |"
            )


if __name__ == "__main__":
    sys.exit(main())
