"""HotTierStore.put's Future: resolved once durable, False when stale, the error when the write failed."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest

from store.errors import StoreError
from store.factory import open_store
from store.hot import HotTierStore
from store.redis_store import RedisStore
from tests.conftest import RedisServer
from tests.store.conftest import assert_same_cache, make_cache, tiny_spec, tokens
from tests.store.test_hot import Factory, _hot


def test_future_resolves_true_once_the_backend_holds_the_cache(backend_factory: Factory) -> None:
    store, backend = _hot(backend_factory)
    backend.gate.clear()
    cache = make_cache(store.spec, tokens(40))
    future = store.put("a", cache)
    assert backend.entered.wait(5)
    assert not future.done()
    assert future.cancel() is False  # a write cannot be cancelled
    backend.gate.set()
    assert future.result(timeout=10) is True
    assert_same_cache(backend_factory(tiny_spec()).get("a"), cache)  # another process sees it
    store.close()


def test_a_superseded_put_follows_the_put_that_replaced_it(backend_factory: Factory) -> None:
    store, backend = _hot(backend_factory)
    backend.gate.clear()
    first = store.put("a", make_cache(store.spec, tokens(10)))
    assert backend.entered.wait(5)  # in flight at the gate
    second = store.put("a", make_cache(store.spec, tokens(20)))
    third = store.put("a", make_cache(store.spec, tokens(30)))  # replaces the second before it is written
    written = threading.Event()
    third.add_done_callback(lambda _f: written.set())
    assert not second.done() and not third.done()
    backend.gate.set()
    assert first.result(timeout=10) is True
    assert third.result(timeout=10) is True
    assert second.result(timeout=0) is True  # resolved with the third, not before
    assert written.is_set()
    assert backend.put_calls == [("a", 10), ("a", 30)]
    store.close()


def test_a_failed_write_puts_its_error_in_the_future(
    backend_factory: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    store, backend = _hot(backend_factory)
    backend.fail = True
    with caplog.at_level(logging.ERROR, logger="kvrq.store"):
        future = store.put("a", make_cache(store.spec, tokens(20)))  # must not raise
        error = future.exception(timeout=10)
    assert isinstance(error, OSError) and "disk on fire" in str(error)
    assert store.stats()["write_errors"] == 1
    assert "disk on fire" in caplog.text
    backend.fail = False
    assert store.put("b", make_cache(store.spec, tokens(20))).result(timeout=10) is True  # still working
    store.close()


def test_synchronous_put_returns_a_finished_future(tmp_path: Path) -> None:
    store = open_store(f"disk:{tmp_path / 's'}", tiny_spec(), write_behind=False)
    future = store.put("a", make_cache(store.spec, tokens(20)))
    assert future.done() and future.result() is True
    store.close()


def test_synchronous_put_carries_a_write_error_instead_of_raising(backend_factory: Factory) -> None:
    store, backend = _hot(backend_factory, write_behind=False)
    backend.fail = True
    future = store.put("a", make_cache(store.spec, tokens(20)))
    assert future.done() and isinstance(future.exception(), OSError)
    assert store.stats()["write_errors"] == 1
    store.close()


@pytest.mark.parametrize("write_behind", [True, False])
def test_a_stale_put_resolves_false_and_leaves_memory(backend_factory: Factory, write_behind: bool) -> None:
    store, backend = _hot(backend_factory, write_behind=write_behind)
    other_worker = backend_factory(tiny_spec())
    newer = make_cache(store.spec, tokens(50, seed=1))
    assert other_worker.put("a", newer, fence=5)
    future = store.put("a", make_cache(store.spec, tokens(40)), fence=4)
    assert future.result(timeout=10) is False
    stats = store.stats()
    assert stats["stale_puts"] == 1 and stats["write_errors"] == 0
    assert_same_cache(store.get("a"), newer)  # memory no longer serves the stale cache
    store.close()


def test_a_delete_resolves_unwritten_puts_false(backend_factory: Factory) -> None:
    store, backend = _hot(backend_factory)
    backend.gate.clear()
    in_flight = store.put("a", make_cache(store.spec, tokens(20)))
    assert backend.entered.wait(5)
    queued = store.put("a", make_cache(store.spec, tokens(30)))
    threading.Timer(0.2, backend.gate.set).start()
    assert store.delete("a") is True
    assert in_flight.result(timeout=10) is True  # it was written before the delete removed it
    assert queued.result(timeout=0) is False
    store.close()


def test_programming_errors_still_raise(backend_factory: Factory) -> None:
    store, _ = _hot(backend_factory)
    cache = make_cache(store.spec, tokens(5))
    with pytest.raises(ValueError):
        store.put("../x", cache)
    with pytest.raises(ValueError):
        store.put("a", cache, fence=-1)
    store.close()
    with pytest.raises(StoreError):
        store.put("a", cache)


@pytest.mark.integration
def test_redis_down_is_a_failed_future_not_an_exception(own_redis_server: RedisServer) -> None:
    spec = tiny_spec()
    store = HotTierStore(RedisStore(own_redis_server.url, spec), 1 << 24)
    cache = make_cache(spec, tokens(40))
    assert store.put("a", cache).result(timeout=30) is True
    own_redis_server.stop(kill=True)
    future = store.put("a", make_cache(spec, tokens(50, seed=1)))
    assert isinstance(future.exception(timeout=60), Exception)
    assert store.stats()["write_errors"] == 1
    own_redis_server.start()  # an empty server on the same port: the store works again
    assert store.put("b", cache).result(timeout=30) is True
    store.close()
