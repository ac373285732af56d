"""The warm-up leaves the engine as it found it (no sequence running, every block free) and keeps KV
buffers ready for the agents the store served last."""

from __future__ import annotations

from engine.batch.engine import BlockPoolBatchEngine
from engine.core.blocks import AgentCache
from engine.core.params import SamplingParams
from engine.core.results import Completion
from tests.engine.tiny import ByteTokenizer, tiny_model
from tests.worker.fakes import SPEC, DictStore, FakeEngine
from worker.warmup import keep_buffers_for_returning_agents, warm_up


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


def test_a_warm_up_that_fails_does_not_stop_the_worker() -> None:
    class Broken(FakeEngine):
        def step(self) -> object:
            raise RuntimeError("no kernels today")

    engine = Broken(pool_blocks=4096)
    assert warm_up(engine) >= 0  # logged, not raised


def stored(store: DictStore, agent: str, n_tokens: int) -> None:
    store.put(agent, AgentCache(SPEC, list(range(n_tokens)), []))


def test_buffers_are_kept_ready_for_the_store_s_most_recent_agents() -> None:
    engine, store = FakeEngine(pool_blocks=4096), DictStore()
    for agent, n in [("old", 10), ("a", 20), ("b", 30), ("newest", 40)]:
        stored(store, agent, n)
    assert keep_buffers_for_returning_agents(engine, store, limit=3) == 3
    assert engine.kept_ready == [[40, 30, 20]]  # the last 3 served, newest first


def test_a_store_that_cannot_list_its_agents_keeps_nothing_ready() -> None:
    class Unlisted(DictStore):
        def list(self) -> list[str]:
            raise ConnectionError("store down")

    engine = FakeEngine(pool_blocks=4096)
    assert keep_buffers_for_returning_agents(engine, Unlisted(), limit=3) == 0
    assert engine.kept_ready == []


def test_on_the_real_engine_the_kept_buffers_are_what_the_returning_agent_resumes_into() -> None:
    """A fresh engine whose arena was stocked for an agent's length resumes that agent without a
    new allocation at submit."""
    model = tiny_model("llama")
    params = SamplingParams(max_tokens=6, stop_tokens=())
    first = BlockPoolBatchEngine(model, ByteTokenizer(), model_name="tiny", pool_blocks=16)
    uid = first.submit("a", list(b"an agent's first turn, long enough"), params)
    done = run_engine(first)[uid]
    first.close()
    assert done.cache is not None
    store = DictStore()
    store.put("a", done.cache)
    fresh = BlockPoolBatchEngine(model, ByteTokenizer(), model_name="tiny", pool_blocks=16)
    try:
        assert keep_buffers_for_returning_agents(fresh, store, limit=4) == 1
        arena = fresh._backend.arena  # type: ignore[attr-defined]
        made = arena.reserved
        uid = fresh.submit("a", list(done.cache.token_ids) + list(b" and more"), params, cache=done.cache)
        run_engine(fresh)
        assert arena.reserved == made and arena.reserved_used == 1, "resumed into the kept set"
    finally:
        fresh.close()


def run_engine(engine: BlockPoolBatchEngine) -> dict[int, Completion]:
    finished: dict[int, Completion] = {}
    while engine.has_work():
        for completion in engine.step().completions:
            finished[completion.uid] = completion
    return finished
