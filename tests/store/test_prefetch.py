"""HotTierStore.prefetch: get's result, computed off the caller's thread, counted once."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import pytest

from engine.core.blocks import AgentCache
from store.disk import DiskStore
from store.errors import StoreError
from store.hot import HotTierStore
from tests.store.conftest import assert_same_cache, make_cache, tiny_spec, tokens


class RecordingDisk(DiskStore):
    """A DiskStore that records which thread reads and can hold reads at a gate."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.readers: list[str] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def get(
        self, agent_id: str, *, prompt_tokens: Sequence[int] | None = None, namespace: str | None = None
    ) -> AgentCache | None:
        self.readers.append(threading.current_thread().name)
        self.entered.set()
        assert self.gate.wait(10)
        return super().get(agent_id, prompt_tokens=prompt_tokens, namespace=namespace)


def _stored(tmp_path: Path, token_ids: list[int]) -> tuple[HotTierStore, RecordingDisk, AgentCache]:
    spec = tiny_spec()
    cache = make_cache(spec, token_ids)
    DiskStore(tmp_path / "s", spec).put("a", cache)  # written by another worker
    backend = RecordingDisk(tmp_path / "s", spec)
    return HotTierStore(backend, 1 << 24), backend, cache


def test_prefetch_reads_on_a_background_thread_with_gets_result(tmp_path: Path) -> None:
    stored = tokens(60)
    store, backend, _ = _stored(tmp_path, stored)
    prompt = stored[:37] + [1, 2, 3]
    future = store.prefetch("a", prompt_tokens=prompt)
    got = future.result(timeout=10)
    assert_same_cache(got, make_cache(store.spec, stored[:37]))
    assert backend.readers and backend.readers[0] != threading.current_thread().name
    assert backend.readers[0].startswith("kvrq-store-prefetch")
    stats = store.stats()
    assert (stats["gets"], stats["hits"], stats["prefetches"]) == (1, 1, 1)
    # The result is in memory now: the next get or prefetch does no backend I/O.
    assert store.prefetch("a", prompt_tokens=prompt).done()
    assert store.stats()["gets"] == 1
    store.close()


def test_a_hot_hit_completes_at_once(tmp_path: Path) -> None:
    store, backend, _ = _stored(tmp_path, tokens(10))
    cache = make_cache(store.spec, tokens(40, seed=3))
    store.put("b", cache)
    future = store.prefetch("b", prompt_tokens=cache.token_ids)
    assert future.done()
    assert future.result() is cache
    assert store.stats()["hot_hits"] == 1 and backend.readers == []
    store.close()


def test_a_miss_is_none(tmp_path: Path) -> None:
    store, _, _ = _stored(tmp_path, tokens(10))
    assert store.prefetch("nobody", prompt_tokens=[1, 2]).result(timeout=10) is None
    assert store.prefetch("a", prompt_tokens=[-5]).result(timeout=10) is None  # nothing shared
    stats = store.stats()
    assert (stats["miss_absent"], stats["miss_no_common_prefix"]) == (1, 1)
    store.close()


def test_a_put_during_the_read_wins(tmp_path: Path) -> None:
    """A prefetch must not hand back an older cache than one put while it was reading."""
    stored = tokens(30)
    store, backend, _ = _stored(tmp_path, stored)
    backend.gate.clear()
    future = store.prefetch("a", prompt_tokens=stored + [9] * 10)
    assert backend.entered.wait(5)
    newer = make_cache(store.spec, stored + [9] * 5)
    store.put("a", newer)
    backend.gate.set()
    assert_same_cache(future.result(timeout=10), newer)
    store.close()


def test_prefetch_refuses_bad_ids_and_a_closed_store(tmp_path: Path) -> None:
    store, _, _ = _stored(tmp_path, tokens(10))
    with pytest.raises(ValueError):
        store.prefetch("../etc", prompt_tokens=[1])
    store.close()
    with pytest.raises(StoreError):
        store.prefetch("other", prompt_tokens=[1])


def test_close_waits_for_prefetches_in_flight(tmp_path: Path) -> None:
    stored = tokens(30)
    store, backend, cache = _stored(tmp_path, stored)
    backend.gate.clear()
    future = store.prefetch("a", prompt_tokens=stored)
    assert backend.entered.wait(5)
    threading.Timer(0.2, backend.gate.set).start()
    store.close()
    assert future.done()
    assert_same_cache(future.result(), cache)
