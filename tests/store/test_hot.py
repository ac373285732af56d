"""The hot tier: memory hits without I/O, write-behind that survives shutdown, LRU by bytes (over every
backend: `backend_factory`)."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.core.blocks import AgentCache
from engine.core.errors import CacheMismatchError
from store.backend import BlockBackend
from store.disk import DiskStore
from store.errors import StoreError
from store.factory import open_store
from store.hot import HotTierStore
from tests.store.conftest import assert_same_cache, make_cache, tiny_spec, tokens

Factory = Callable[..., BlockBackend]


class Gate:
    """Holds a backend's puts at a gate and can make them fail, to observe write-behind (it replaces
    the backend's `put` on that one object)."""

    def __init__(self, backend: BlockBackend) -> None:
        self.backend = backend
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.fail = False
        self.put_calls: list[tuple[str, int]] = []
        self._put = backend.put
        backend.put = self.put  # type: ignore[method-assign]

    def put(
        self, agent_id: str, cache: AgentCache, *, fence: int | None = None, namespace: str | None = None
    ) -> bool:
        self.entered.set()
        assert self.gate.wait(10)
        self.put_calls.append((agent_id, cache.n_tokens))
        if self.fail:
            raise OSError("disk on fire")
        return self._put(agent_id, cache, fence=fence, namespace=namespace)


def _hot(factory: Factory, capacity: int = 1 << 24, **kwargs: object) -> tuple[HotTierStore, Gate]:
    gate = Gate(factory(tiny_spec()))
    return HotTierStore(gate.backend, capacity, **kwargs), gate  # type: ignore[arg-type]


def test_hit_after_put_does_no_backend_io(backend_factory: Factory) -> None:
    store, backend = _hot(backend_factory)
    cache = make_cache(store.spec, tokens(40))
    store.put("a", cache)
    store.flush()
    assert store.get("a") is cache
    stats = store.stats()
    assert stats["gets"] == 0 and stats["hot_hits"] == 1  # the backend was not asked
    store.close()


def test_memory_older_than_the_previous_turn_is_not_served(backend_factory: Factory) -> None:
    """Two workers' hot tiers over one backend: an agent's turn 3 on worker A must see what turn 2
    wrote on worker B, not A's own turn-1 cache still in memory."""
    backend = backend_factory(tiny_spec())
    a, b = HotTierStore(backend, 1 << 24), HotTierStore(backend, 1 << 24)
    turn1 = make_cache(a.spec, tokens(40))
    assert a.put("agent", turn1, fence=1).result(timeout=10)
    turn2 = make_cache(b.spec, tokens(90))
    assert b.put("agent", turn2, fence=2).result(timeout=10)
    newest = a.prefetch("agent", prompt_tokens=tokens(100), fence=3).result(timeout=10)
    assert newest is not None
    assert_same_cache(newest, turn2)
    stats = a.stats()
    assert stats["hot_misses"] == 1 and stats["hits"] == 1
    assert a.get("agent", fence=3) is not None and a.stats()["hot_hits"] == 1  # now fresh in memory
    assert a.get("agent", fence=2) is not None  # a turn right after its own put: served from memory
    a.close()
    b.close()


def test_close_flushes_every_pending_write(backend_factory: Factory) -> None:
    store, backend = _hot(backend_factory)
    backend.gate.clear()
    caches = {f"a{i}": make_cache(store.spec, tokens(20 + i, seed=i)) for i in range(5)}
    for agent, cache in caches.items():
        store.put(agent, cache)
    assert store.stats()["pending_writes"] == 5
    threading.Timer(0.2, backend.gate.set).start()
    store.close()
    reopened = backend_factory(tiny_spec())
    for agent, cache in caches.items():
        assert_same_cache(reopened.get(agent), cache)
    assert store.stats()["writes_behind"] == 5
    store.close()  # twice is fine


def test_an_agent_put_repeatedly_is_written_once_per_drain(backend_factory: Factory) -> None:
    store, backend = _hot(backend_factory)
    backend.gate.clear()
    store.put("a", make_cache(store.spec, tokens(10)))
    assert backend.entered.wait(5)  # the first put is in flight, held at the gate
    for n in (20, 30, 40):
        store.put("a", make_cache(store.spec, tokens(n)))
        assert store.get("a").n_tokens == n  # type: ignore[union-attr]  # newest, even before it is written
    backend.gate.set()
    store.flush()
    assert backend.put_calls == [("a", 10), ("a", 40)]
    assert backend_factory(tiny_spec()).get("a").n_tokens == 40  # type: ignore[union-attr]
    store.close()


def test_lru_eviction_by_bytes(backend_factory: Factory, caplog: pytest.LogCaptureFixture) -> None:
    spec = tiny_spec()
    size = make_cache(spec, tokens(20)).nbytes
    store, backend = _hot(backend_factory, capacity=int(2.5 * size))
    for agent in ("a", "b"):
        store.put(agent, make_cache(spec, tokens(20, seed=ord(agent))))
    store.get("a")
    store.put("c", make_cache(spec, tokens(20, seed=3)))  # b is least recently used
    store.flush()
    stats = store.stats()
    assert (stats["hot_evictions"], stats["hot_entries"], stats["hot_bytes"]) == (1, 2, 2 * size)
    before = store.stats()["gets"]
    assert_same_cache(store.get("b"), make_cache(spec, tokens(20, seed=ord("b"))))  # from the backend
    assert store.stats()["gets"] == before + 1
    # Bringing b back evicted a (now the least recently used); c is still in memory.
    assert store.get("c") is not None and store.stats()["gets"] == before + 1
    assert store.get("a") is not None and store.stats()["gets"] == before + 2
    assert store.stats()["hot_evictions"] == 3
    store.close()


def test_a_cache_larger_than_the_tier_is_still_written(backend_factory: Factory) -> None:
    store, backend = _hot(backend_factory, capacity=10)
    cache = make_cache(store.spec, tokens(40))
    store.put("a", cache)
    store.close()
    assert store.stats()["hot_entries"] == 0
    assert_same_cache(backend_factory(tiny_spec()).get("a"), cache)


def test_write_errors_are_counted_and_logged(
    backend_factory: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    store, backend = _hot(backend_factory)
    backend.fail = True
    with caplog.at_level(logging.ERROR, logger="kvrq.store"):
        store.put("a", make_cache(store.spec, tokens(20)))
        store.flush()
    assert store.stats()["write_errors"] == 1
    assert "'a'" in caplog.text and "disk on fire" in caplog.text
    assert store.get("a") is not None  # still served from memory
    store.close()


def test_puts_wait_when_too_much_is_unwritten(backend_factory: Factory) -> None:
    spec = tiny_spec()
    size = make_cache(spec, tokens(20)).nbytes
    store, backend = _hot(backend_factory, max_pending_bytes=int(1.5 * size))
    backend.gate.clear()
    store.put("a", make_cache(spec, tokens(20)))  # in flight at the gate
    assert backend.entered.wait(5)
    store.put("b", make_cache(spec, tokens(20, seed=1)))  # pending: 1 cache
    done = threading.Event()

    def third() -> None:
        store.put("c", make_cache(spec, tokens(20, seed=2)))  # would make 2 pending: must wait
        done.set()

    thread = threading.Thread(target=third)
    thread.start()
    assert not done.wait(0.3)
    backend.gate.set()
    assert done.wait(5)
    thread.join()
    store.close()


def test_delete_drops_pending_writes_and_waits_for_the_one_in_flight(backend_factory: Factory) -> None:
    store, backend = _hot(backend_factory)
    backend.gate.clear()
    store.put("a", make_cache(store.spec, tokens(20)))
    assert backend.entered.wait(5)
    store.put("a", make_cache(store.spec, tokens(30)))  # queued behind the in-flight write
    threading.Timer(0.2, backend.gate.set).start()
    assert store.delete("a") is True
    store.flush()
    assert store.get("a") is None
    assert backend_factory(tiny_spec()).get("a") is None
    assert backend.put_calls == [("a", 20)]
    store.close()


def test_prompt_prefix_from_memory(backend_factory: Factory) -> None:
    store, _ = _hot(backend_factory)
    stored = tokens(40)
    store.put("a", make_cache(store.spec, stored))
    got = store.get("a", prompt_tokens=stored[:25] + [1, 2])
    assert_same_cache(got, make_cache(store.spec, stored[:25]))
    assert store.get("a", prompt_tokens=[stored[0] + 1]) is None
    assert store.stats()["miss_no_common_prefix"] == 1
    store.close()


def test_put_checks_the_cache_and_refuses_after_close(backend_factory: Factory) -> None:
    store, _ = _hot(backend_factory)
    with pytest.raises(CacheMismatchError):
        store.put("a", make_cache(tiny_spec(name="other"), tokens(5)))
    store.close()
    with pytest.raises(StoreError):
        store.put("a", make_cache(store.spec, tokens(5)))


def test_list_and_info_include_unwritten_caches(backend_factory: Factory) -> None:
    store, backend = _hot(backend_factory)
    store.put("a", make_cache(store.spec, tokens(20)))
    store.flush()
    backend.gate.clear()
    store.put("b", make_cache(store.spec, tokens(30)))
    assert store.list() == ["a", "b"]
    info = store.info("b")
    assert info is not None and info.n_tokens == 30
    backend.gate.set()
    store.close()


def test_synchronous_mode_writes_before_returning(tmp_path: Path) -> None:
    store = open_store(f"disk:{tmp_path / 's'}", tiny_spec(), write_behind=False)
    cache = make_cache(store.spec, tokens(20))
    store.put("a", cache)
    assert_same_cache(DiskStore(tmp_path / "s", tiny_spec()).get("a"), cache)
    store.close()


def test_open_store_uris(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        open_store("s3://bucket", tiny_spec())
    with pytest.raises(ValueError):
        open_store("disk:", tiny_spec())
    with pytest.raises(ValueError):
        open_store(f"disk:{tmp_path}", tiny_spec(), quantization="q3")  # type: ignore[arg-type]
    store = open_store("redis://127.0.0.1:1/0", tiny_spec(), prefix="x:")
    assert store.backend.kind == "redis"
    store.close()


@pytest.mark.integration
def test_interpreter_exit_flushes_without_close(tmp_path: Path) -> None:
    """A worker that forgets close() still writes its caches on a normal exit."""
    uri = f"disk:{tmp_path / 's'}"
    script = f"""
import sys; sys.path.insert(0, {str(Path(__file__).parents[2])!r})
from tests.store.conftest import make_cache, tiny_spec, tokens
import time
from store.factory import open_store
store = open_store({uri!r}, tiny_spec())
slow_put = store.backend.put
def put(agent_id, cache, fence=None, namespace=None):
    time.sleep(0.3)
    return slow_put(agent_id, cache, fence=fence, namespace=namespace)
store.backend.put = put
store.put("a", make_cache(tiny_spec(), tokens(40)))
"""
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    assert time.monotonic() - started >= 0.3
    assert_same_cache(DiskStore(tmp_path / "s", tiny_spec()).get("a"), make_cache(tiny_spec(), tokens(40)))
