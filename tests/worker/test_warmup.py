"""The warm-up leaves the engine as it found it (no sequence running, every block free) and keeps KV
buffers ready for the agents the store served last."""

from __future__ import annotations

import logging
from pathlib import Path

import fakeredis
import pytest

from engine.batch.engine import BlockPoolBatchEngine
from engine.core.blocks import AgentCache
from engine.core.params import SamplingParams
from producer.wire.protocol import agent_fence_key, agent_lock_key
from store import open_store
from tests.engine.test_ragged import run_all
from tests.engine.tiny import ByteTokenizer, tiny_model
from tests.store.conftest import make_cache, tiny_spec, tokens
from tests.worker.fakes import SPEC, DictStore, FakeEngine
from worker.warmup import (
    keep_buffers_for_returning_agents,
    read_returning_agents,
    returning_agents,
    warm_up,
)
from worker.warmup import log as warmup_log


def test_warm_up_on_the_real_engine_leaves_nothing_behind() -> None:
    engine = BlockPoolBatchEngine(tiny_model("llama"), ByteTokenizer(), model_name="tiny", pool_blocks=16)
    try:
        assert warm_up(engine) > 0
        assert not engine.has_work() and engine.pool.used_blocks == 0
        assert engine.free_slots() == engine.max_batch
    finally:
        engine.close()


def test_warm_up_resumes_the_cache_it_cut() -> None:
    engine = FakeEngine(pool_blocks=4096)
    warm_up(engine)
    (first, _, reused_first), (second, _, reused_second), _fresh = engine.submitted
    assert reused_first == 0 and reused_second > 0  # the resume path ran
    assert not engine.has_work() and engine.pool.used_blocks == 0


def test_a_pool_too_small_for_the_warm_up_rows_leaves_them_out() -> None:
    engine = FakeEngine(pool_blocks=76)  # 300 + 4 tokens in blocks of 4: the resumed row (328) never fits
    warm_up(engine)
    assert [len(prompt) for _, prompt, _ in engine.submitted] == [300, 40]
    assert engine.pool.used_blocks == 0


def test_a_warm_up_that_fails_does_not_stop_the_worker(caplog: pytest.LogCaptureFixture) -> None:
    class Broken(FakeEngine):
        def step(self) -> object:
            raise RuntimeError("no kernels today")

    engine = Broken(pool_blocks=4096)
    with caplog.at_level(logging.WARNING, logger=warmup_log.name):
        warm_up(engine)  # returns instead of raising
    failed = [record for record in caplog.records if "warm-up failed" in record.getMessage()]
    assert len(failed) == 1 and failed[0].exc_info is not None
    assert "no kernels today" in str(failed[0].exc_info[1])


def stored(store: DictStore, agent: str, n_tokens: int) -> None:
    store.put(agent, AgentCache(SPEC, list(range(n_tokens)), []))


def test_buffers_are_kept_ready_for_the_store_s_most_recent_agents() -> None:
    engine, store = FakeEngine(pool_blocks=4096), DictStore()
    for agent, n in [("old", 10), ("a", 20), ("b", 30), ("newest", 40)]:
        stored(store, agent, n)
    assert keep_buffers_for_returning_agents(engine, returning_agents(store, limit=3)) == 3
    assert engine.kept_ready == [[40, 30, 20]]  # the last 3 served, newest first


def test_a_store_that_cannot_list_its_agents_keeps_nothing_ready() -> None:
    class Unlisted(DictStore):
        def list(self) -> list[str]:
            raise ConnectionError("store down")

    engine = FakeEngine(pool_blocks=4096)
    assert returning_agents(Unlisted(), limit=3) == []
    assert keep_buffers_for_returning_agents(engine, []) == 0


def test_on_the_real_engine_the_kept_buffers_are_what_the_returning_agent_resumes_into() -> None:
    """A fresh engine whose arena was stocked for an agent's length resumes that agent without a
    new allocation at submit."""
    model = tiny_model("llama")
    params = SamplingParams(max_tokens=6, stop_tokens=())
    first = BlockPoolBatchEngine(model, ByteTokenizer(), model_name="tiny", pool_blocks=16)
    uid = first.submit("a", list(b"an agent's first turn, long enough"), params)
    done = run_all(first)[uid]
    first.close()
    assert done.cache is not None
    store = DictStore()
    store.put("a", done.cache)
    fresh = BlockPoolBatchEngine(model, ByteTokenizer(), model_name="tiny", pool_blocks=16)
    try:
        assert keep_buffers_for_returning_agents(fresh, returning_agents(store, limit=4)) == 1
        arena = fresh._backend.arena  # type: ignore[attr-defined]
        made = arena.reserved
        uid = fresh.submit("a", list(done.cache.token_ids) + list(b" and more"), params, cache=done.cache)
        run_all(fresh)
        assert arena.reserved == made and arena.reserved_used == 1, "resumed into the kept set"
    finally:
        fresh.close()


def test_returning_agents_are_read_into_memory_as_fresh_as_their_last_turn(tmp_path: Path) -> None:
    """A free agent's cache is read at start and serves its next turn from memory; an agent whose
    lock is held (a turn running elsewhere) is left alone; a turn two fences on reads the store."""
    spec = tiny_spec()
    store = open_store(f"disk://{tmp_path}", spec)
    redis = fakeredis.FakeRedis()
    try:
        for agent in ("free", "busy", "skipped-on"):
            store.put(agent, make_cache(spec, tokens(40, seed=len(agent)))).result()
            redis.set(agent_fence_key(agent), 5)
        redis.set(agent_lock_key("busy"), "other-worker/job-1")
        store.close()
        store = open_store(f"disk://{tmp_path}", spec)  # a fresh worker's store: nothing in memory
        agents = returning_agents(store, limit=10)
        assert {info.agent_id for info in agents} == {"free", "busy", "skipped-on"}
        read = read_returning_agents(
            redis, store, agents, budget_bytes=10**9, bytes_per_token=spec.bytes_per_token()
        )
        assert read == 2  # free and skipped-on
        before = store.stats()
        assert store.prefetch("free", prompt_tokens=None, fence=6).done()  # its next turn: memory
        assert store.stats()["hot_hits"] == before["hot_hits"] + 1
        store.prefetch("busy", prompt_tokens=None, fence=6).result()
        store.prefetch("skipped-on", prompt_tokens=None, fence=7).result()  # turn 6 ran elsewhere
        assert store.stats()["hot_misses"] == before["hot_misses"] + 2
    finally:
        store.close()


def test_reading_returning_agents_stays_within_the_hot_tier_budget(tmp_path: Path) -> None:
    spec = tiny_spec()
    store = open_store(f"disk://{tmp_path}", spec)
    redis = fakeredis.FakeRedis()
    try:
        for agent in ("a", "b", "c"):
            store.put(agent, make_cache(spec, tokens(40))).result()
            redis.set(agent_fence_key(agent), 1)
        agents = returning_agents(store, limit=10)
        one = 40 * spec.bytes_per_token()
        assert (
            read_returning_agents(
                redis, store, agents, budget_bytes=2 * one, bytes_per_token=spec.bytes_per_token()
            )
            == 2
        )
    finally:
        store.close()
