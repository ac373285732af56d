"""The warm-up leaves the engine as it found it: no sequence running, every block free."""

from __future__ import annotations

from engine.batch.engine import BlockPoolBatchEngine
from tests.engine.tiny import ByteTokenizer, tiny_model
from tests.worker.fakes import FakeEngine
from worker.warmup import warm_up


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
