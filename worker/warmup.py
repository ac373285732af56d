"""Run the engine's paths once before the worker takes its first job.

A fresh process pays for its first prefill, first decode step, first resumed cache and first block
cut (MLX compiles and caches kernels per shape, the C attention loads, memory is touched for the
first time). Measured after a restart: returning agents' first tokens came ~2x slower than the same
turns a minute later. Paid here, before the worker registers with rq, no job waits behind it.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import wait

from redis import Redis
from redis.exceptions import RedisError

from engine.core.blocks import AgentCache
from engine.core.params import SamplingParams
from engine.core.results import Completion
from producer.wire.protocol import agent_fence_key, agent_lock_key
from store.base import CacheInfo
from worker.loop.ports import Engine, Store

log = logging.getLogger("kvrq.worker")

#: The most time spent finding which agents the store served last (a store of many agents is read
#: only this long; those seen so far count).
RETURNING_LOOKUP_S = 2.0

#: Long enough for a full block and a partial one (the shapes real prompts take), short enough to
#: cost a second or two on a CPU.
PROMPT_TOKENS = 300


def warm_up(engine: Engine) -> float:
    """Prefill, decode, cut to blocks, resume from the cut cache beside a fresh row: seconds spent.

    Rows that do not fit the engine's budgets (a tiny pool) are left out; a warm-up that fails is
    logged and skipped: it only saves time, the worker must start without it."""
    started = time.perf_counter()
    try:
        _warm(engine)
    except Exception:
        log.warning("engine warm-up failed; starting without it", exc_info=True)
    spent = time.perf_counter() - started
    log.info("engine warmed up in %.1f s", spent)
    return spent


def _warm(engine: Engine) -> None:
    vocab = max(2, engine.vocab_size or 256)
    prompt = [(17 + 31 * i) % vocab for i in range(PROMPT_TOKENS)]
    params = SamplingParams(max_tokens=4, stop_tokens=())
    first = _submit(engine, prompt, params, keep_cache=True)
    if first is None:
        return
    cache = _run(engine, {first})[first].cache
    rows = {
        uid
        for uid in (
            _submit(engine, [*prompt, *prompt[:24]], params, cache=cache),
            _submit(engine, prompt[:40], params),
        )
        if uid is not None
    }
    _run(engine, rows)


def _submit(
    engine: Engine,
    prompt: list[int],
    params: SamplingParams,
    *,
    cache: AgentCache | None = None,
    keep_cache: bool = False,
) -> int | None:
    """The row's uid, or None where the engine's budgets (slots, blocks, context) leave no room now."""
    if engine.admission(len(prompt), params.max_tokens).verdict != "now":
        return None
    return engine.submit(None, prompt, params, cache=cache, keep_cache=keep_cache)


def _run(engine: Engine, uids: set[int], max_steps: int = 10_000) -> dict[int, Completion]:
    done: dict[int, Completion] = {}
    for _ in range(max_steps):
        if uids <= done.keys():
            return done
        for completion in engine.step().completions:
            done[completion.uid] = completion
    raise RuntimeError(f"the engine did not finish its warm-up rows in {max_steps} steps")


def returning_agents(store: Store, limit: int) -> list[CacheInfo]:
    """The `limit` agents the store served last, newest first: those most likely to come back first
    to a worker starting on it. A store that cannot list its agents gives none (logged)."""
    started = time.perf_counter()
    infos: list[CacheInfo] = []
    try:
        for agent_id in store.list():
            if time.perf_counter() - started > RETURNING_LOOKUP_S:
                break
            info = store.info(agent_id)
            if info is not None:
                infos.append(info)
    except Exception:
        log.warning("could not list the store's agents; nothing made ready for them", exc_info=True)
        return []
    return sorted(infos, key=lambda info: info.last_used, reverse=True)[:limit]


def keep_buffers_for_returning_agents(engine: Engine, agents: list[CacheInfo]) -> int:
    """KV buffers, idle and ready, for `agents` (returning_agents): sets made.

    A warm worker resumes an agent into buffers an earlier sequence left; a fresh one would make
    new ones on the step thread as each agent joins, and new memory is slow to come by: on this
    project's 2-core VM, 0.2-0.3 s for one 900-token SmolLM2 agent, paid one agent after another
    with the batch waiting, when twelve agents returned to a restarted worker at once (a
    4.4 s first token against 1.4 s for the same burst on the warm worker). Sized for each agent's
    stored tokens (a set comes with a block of room: the next turn)."""
    started = time.perf_counter()
    made = engine.keep_ready([info.n_tokens for info in agents])
    log.info(
        "KV buffers ready for %d of %d returning agents in %.1f s",
        made,
        len(agents),
        time.perf_counter() - started,
    )
    return made


def read_returning_agents(
    connection: Redis,
    store: Store,
    agents: list[CacheInfo],
    *,
    budget_bytes: int,
    bytes_per_token: int,
    timeout_s: float = 60.0,
) -> int:
    """Read `agents`' caches into the store's memory (the hot tier) before the first job, each as
    fresh as the last turn its agent ended: caches read.

    Why the turn matters: the hot tier serves a job only a cache at least as new as its agent's
    previous turn (the fence), or another worker's newer cache would be missed. An agent whose
    lock is free has no turn running; the store then holds the cache of its last turn (the lock is
    released only once that cache is durable), whose fence the counter shows: read then, the
    cache is at least that new, and a turn that starts meanwhile only makes it newer. An agent
    whose lock is held is left alone: its cache is about to change. Newest agents are read last,
    so that a hot tier too small for all of them keeps those; `budget_bytes` (the hot tier's) bounds
    the reads, at `bytes_per_token` in memory."""
    started = time.perf_counter()
    chosen: list[tuple[str, int]] = []
    room = budget_bytes
    keys = [key for info in agents for key in (agent_lock_key(info.agent_id), agent_fence_key(info.agent_id))]
    try:
        turns = connection.mget(keys) if keys else []  # every lock with its fence, in one read
    except RedisError:
        log.warning("could not read the agents' turns; their caches are read when they come", exc_info=True)
        return 0
    for info, lock, fence in zip(agents, turns[::2], turns[1::2], strict=True):
        size = info.n_tokens * bytes_per_token
        if lock is not None or fence is None or size > room:
            continue
        room -= size
        chosen.append((info.agent_id, int(fence)))
    reads = [store.prefetch(agent_id, prompt_tokens=None, fence=fence) for agent_id, fence in chosen[::-1]]
    done, _ = wait(reads, timeout=timeout_s)
    read = sum(1 for future in done if future.exception() is None and future.result() is not None)
    log.info(
        "read %d of the store's %d most recent agents into memory in %.1f s",
        read,
        len(agents),
        time.perf_counter() - started,
    )
    return read
