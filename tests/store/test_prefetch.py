"""HotTierStore.prefetch: get's result, computed off the caller's thread, counted once (over every
backend: `backend_factory`)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest

from engine.core.blocks import AgentCache
from store.backend import BlockBackend
from store.errors import StoreError
from store.hot import HotTierStore
from tests.store.conftest import assert_same_cache, make_cache, tiny_spec, tokens
from tests.store.test_hot import Factory


class Recorder:
    """Records which thread reads a backend and can hold its reads at a gate (it replaces the
    backend's `get` on that one object)."""

    def __init__(self, backend: BlockBackend) -> None:
        self.backend = backend
        self.readers: list[str] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self._get = backend.get
        backend.get = self.get  # type: ignore[method-assign]

    def get(
        self, agent_id: str, *, prompt_tokens: Sequence[int] | None = None, namespace: str | None = None
    ) -> AgentCache | None:
        self.readers.append(threading.current_thread().name)
        self.entered.set()
        assert self.gate.wait(10)
        return self._get(agent_id, prompt_tokens=prompt_tokens, namespace=namespace)


def _stored(factory: Factory, token_ids: list[int]) -> tuple[HotTierStore, Recorder, AgentCache]:
    spec = tiny_spec()
    cache = make_cache(spec, token_ids)
    factory(spec).put("a", cache)  # written by another worker
    recorder = Recorder(factory(spec))
    return HotTierStore(recorder.backend, 1 << 24), recorder, cache


def test_prefetch_reads_on_a_background_thread_with_gets_result(backend_factory: Factory) -> None:
    stored = tokens(60)
    store, backend, _ = _stored(backend_factory, stored)
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


def test_a_hot_hit_completes_at_once(backend_factory: Factory) -> None:
    store, backend, _ = _stored(backend_factory, tokens(10))
    cache = make_cache(store.spec, tokens(40, seed=3))
    store.put("b", cache)
    future = store.prefetch("b", prompt_tokens=cache.token_ids)
    assert future.done()
    assert future.result() is cache
    assert store.stats()["hot_hits"] == 1 and backend.readers == []
    store.close()


def test_a_miss_is_none(backend_factory: Factory) -> None:
    store, _, _ = _stored(backend_factory, tokens(10))
    assert store.prefetch("nobody", prompt_tokens=[1, 2]).result(timeout=10) is None
    assert store.prefetch("a", prompt_tokens=[-5]).result(timeout=10) is None  # nothing shared
    stats = store.stats()
    assert (stats["miss_absent"], stats["miss_no_common_prefix"]) == (1, 1)
    store.close()


def test_a_put_during_the_read_wins(backend_factory: Factory) -> None:
    """A prefetch must not hand back an older cache than one put while it was reading."""
    stored = tokens(30)
    store, backend, _ = _stored(backend_factory, stored)
    backend.gate.clear()
    future = store.prefetch("a", prompt_tokens=stored + [9] * 10)
    assert backend.entered.wait(5)
    newer = make_cache(store.spec, stored + [9] * 5)
    store.put("a", newer)
    backend.gate.set()
    assert_same_cache(future.result(timeout=10), newer)
    store.close()


def test_prefetch_refuses_bad_ids_and_a_closed_store(backend_factory: Factory) -> None:
    store, _, _ = _stored(backend_factory, tokens(10))
    with pytest.raises(ValueError):
        store.prefetch("../etc", prompt_tokens=[1])
    store.close()
    with pytest.raises(StoreError):
        store.prefetch("other", prompt_tokens=[1])


def test_close_waits_for_prefetches_in_flight(backend_factory: Factory) -> None:
    stored = tokens(30)
    store, backend, cache = _stored(backend_factory, stored)
    backend.gate.clear()
    future = store.prefetch("a", prompt_tokens=stored)
    assert backend.entered.wait(5)
    threading.Timer(0.2, backend.gate.set).start()
    store.close()
    assert future.done()
    assert_same_cache(future.result(), cache)
