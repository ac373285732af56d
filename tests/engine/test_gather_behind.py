"""A warm row's cache is copied in behind the step: layer by layer, each layer read only once copied."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from engine import kv_convert
from engine.engine import BlockPoolBatchEngine
from engine.kv_convert import GatheringKVCache
from engine.params import SamplingParams
from tests.engine.test_ragged import make_engine, prompt, run_all, saved_cache
from tests.engine.tiny import tiny_model

PARAMS = SamplingParams(max_tokens=12, stop_tokens=())


@pytest.fixture
def engine() -> BlockPoolBatchEngine:
    return make_engine(tiny_model("llama"), prefill_tokens_per_step=64)


def slow_copies(monkeypatch: pytest.MonkeyPatch, seconds: float) -> list[str]:
    """Make every layer copy of a gather take `seconds`; returns the copying threads' names."""
    threads: list[str] = []
    real = kv_convert._concatenate_into

    def slow(destination: Any, sources: Any, n_tokens: int) -> None:
        threads.append(threading.current_thread().name)
        time.sleep(seconds)
        real(destination, sources, n_tokens)

    monkeypatch.setattr(kv_convert, "_concatenate_into", slow)
    return threads


def test_each_layer_is_read_only_after_its_copy_and_the_row_resumes_like_a_fresh_prefill(
    engine: BlockPoolBatchEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = saved_cache(engine, 120)
    full = cache.token_ids + prompt(6, salt=3)
    fresh = make_engine(tiny_model("llama"))
    fresh_uid = fresh.submit(None, full, PARAMS)
    expected = run_all(fresh)[fresh_uid].token_ids
    threads = slow_copies(monkeypatch, 0.01)
    events: list[tuple[str, int]] = []  # ("copied" | "read", layer), in the order they happened
    real_copy = kv_convert._concatenate_into

    def copy_then_log(destination: Any, sources: Any, n_tokens: int) -> None:
        real_copy(destination, sources, n_tokens)
        calls = len(threads)  # K then V of each layer, layers in order
        if calls % 2 == 0:
            events.append(("copied", calls // 2 - 1))

    monkeypatch.setattr(kv_convert, "_concatenate_into", copy_then_log)
    real_update = GatheringKVCache.update_and_fetch

    def update_then_log(self: GatheringKVCache, keys: Any, values: Any) -> Any:
        out = real_update(self, keys, values)
        events.append(("read", layers.index(self)))
        return out

    monkeypatch.setattr(GatheringKVCache, "update_and_fetch", update_then_log)
    started = time.perf_counter()
    uid = engine.submit("agent", full, PARAMS, cache=cache)
    submit_s = time.perf_counter() - started
    layers = engine._backend.generator.rows[uid].layers  # type: ignore[attr-defined]
    assert all(isinstance(layer, GatheringKVCache) for layer in layers)
    assert submit_s < 0.01 * 2 * len(layers), "submit did not wait for the copy"
    done = run_all(engine)
    for index in range(len(layers)):
        assert events.index(("copied", index)) < events.index(("read", index)), f"layer {index} read early"
    assert done[uid].token_ids == expected
    assert done[uid].usage.reused_tokens == cache.n_tokens
    assert threads and all(name.startswith("kvrq-gather") for name in threads), "copied off the caller"


def test_a_row_taken_out_before_its_first_step_waits_for_its_copy(
    engine: BlockPoolBatchEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = saved_cache(engine, 120)
    slow_copies(monkeypatch, 0.01)
    uid = engine.submit("agent", cache.token_ids + prompt(4), PARAMS, cache=cache)
    layers = engine._backend.generator.rows[uid].layers  # type: ignore[attr-defined]
    assert not all(layer.gathered.is_set() for layer in layers), "the copy is still running"
    assert engine.cancel(uid) is not None
    assert all(layer.gathered.is_set() for layer in layers), "its buffers went back only once written"


def test_a_failed_copy_fails_the_step_that_reads_it(
    engine: BlockPoolBatchEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = saved_cache(engine, 120)

    def broken(destination: Any, sources: Any, n_tokens: int) -> None:
        raise MemoryError("no room")

    monkeypatch.setattr(kv_convert, "_concatenate_into", broken)
    engine.submit("agent", cache.token_ids + prompt(4), PARAMS, cache=cache)
    with pytest.raises(RuntimeError, match="gathering the cached K/V failed"):
        engine.step()
