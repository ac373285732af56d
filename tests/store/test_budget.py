"""Backend byte budgets: least recently used agents go first; evictions are logged and counted."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import pytest

from store.agent_ids import agent_key
from store.disk import DiskStore
from store.redis_store import RedisStore
from tests.store.conftest import make_cache, redis_value_keys, tiny_spec, tokens
from tests.store.test_corruption import Raw

Factory = Callable[..., DiskStore | RedisStore]


def _size(factory: Factory) -> int:
    probe = factory(tiny_spec())
    probe.put("probe", make_cache(tiny_spec(), tokens(20)))
    info = probe.info("probe")
    assert info is not None
    probe.delete("probe")
    return info.nbytes


def test_least_recently_used_is_evicted_first(
    backend_factory: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    size = _size(backend_factory)
    spec = tiny_spec()
    store = backend_factory(spec, max_bytes=int(3.5 * size))
    for agent in ("a", "b", "c"):
        store.put(agent, make_cache(spec, tokens(20, seed=ord(agent))))
        time.sleep(0.01)
    assert store.get("a") is not None  # a is now the most recently used
    info_b = store.info("b")
    assert info_b is not None
    time.sleep(0.01)
    with caplog.at_level(logging.INFO, logger="kvrq.store"):
        store.put("d", make_cache(spec, tokens(20, seed=4)))
    assert store.list() == ["a", "c", "d"]
    stats = store.stats()
    assert (stats["evictions"], stats["evicted_bytes"]) == (1, info_b.nbytes)
    assert "evicted agent 'b'" in caplog.text
    time.sleep(0.01)
    store.put("e", make_cache(spec, tokens(20, seed=5)))
    assert store.list() == ["a", "d", "e"]  # c was next in line
    assert sum(i.nbytes for i in (store.info(x) for x in store.list()) if i) <= 3.5 * size


def test_the_agent_just_put_is_kept_even_alone_over_budget(backend_factory: Factory) -> None:
    size = _size(backend_factory)
    spec = tiny_spec()
    store = backend_factory(spec, max_bytes=size // 2)
    store.put("a", make_cache(spec, tokens(20)))
    store.put("b", make_cache(spec, tokens(20, seed=1)))
    assert store.list() == ["b"]
    assert store.get("b") is not None


def test_budget_counts_what_other_store_instances_wrote(backend_factory: Factory) -> None:
    size = _size(backend_factory)
    spec = tiny_spec()
    first = backend_factory(spec)  # no budget: another worker sharing the storage
    for agent in ("a", "b"):
        first.put(agent, make_cache(spec, tokens(20, seed=ord(agent))))
        time.sleep(0.01)
    second = backend_factory(spec, max_bytes=int(2.5 * size))
    second.put("c", make_cache(spec, tokens(20, seed=3)))
    assert second.list() == ["b", "c"]


def test_growing_an_agent_counts_its_new_size_once(backend_factory: Factory) -> None:
    size = _size(backend_factory)
    spec = tiny_spec()
    store = backend_factory(spec, max_bytes=int(2.5 * size))
    store.put("a", make_cache(spec, tokens(20)))
    time.sleep(0.01)
    for n in (20, 20, 20):
        store.put("b", make_cache(spec, tokens(n, seed=1)))  # replacing, not adding up
    assert store.list() == ["a", "b"]
    assert store.stats()["evictions"] == 0


def test_invalid_budget_is_refused(backend_factory: Factory) -> None:
    with pytest.raises(ValueError):
        backend_factory(tiny_spec(), max_bytes=0)


def test_budget_counts_damaged_caches_and_can_evict_them(backend_factory: Factory) -> None:
    """A cache whose manifest no longer reads still takes space: the budget counts it and evicts it
    with its own blocks (disk: its directory; Redis: its committed values, found by their key pattern)."""
    spec = tiny_spec()
    store = backend_factory(spec)
    store.put("junk", make_cache(spec, tokens(20)))  # a shared full block and a partial one of its own
    raw = Raw(store, "junk")
    raw.write(raw.manifest_location(), b"garbage")
    size = make_cache(spec, tokens(20)).nbytes
    assert _own_blocks(store, "junk") > 0
    budgeted = backend_factory(spec, max_bytes=int(1.5 * size))
    budgeted.put("a", make_cache(spec, tokens(20, seed=1)))
    assert budgeted.stats()["evictions"] == 1
    assert store._info_record("junk") is None
    assert _own_blocks(store, "junk") == 0


def _own_blocks(store: DiskStore | RedisStore, agent_id: str) -> int:
    """How many blocks an agent holds, whatever its manifest says (disk: the files of its directory,
    links to shared blocks included; Redis: its own values)."""
    if isinstance(store, DiskStore):
        blocks = store._agent_dir(agent_id) / "blocks"
        return len(list(blocks.iterdir())) if blocks.exists() else 0
    own = f"{store.prefix}{agent_key(agent_id)}:b:"
    return sum(1 for key in redis_value_keys(store._client, store.prefix) if key.startswith(own))
