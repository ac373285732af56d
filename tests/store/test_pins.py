"""Pinned agents (`kvrq cache pin`): never evicted by a budget or a TTL, on disk and in Redis (shared
blocks a pinned agent uses included); delete removes an agent's blocks and leaves shared blocks
to their other users. Against a real directory and a real redis-server."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from producer.wire.ids import InvalidAgentIdError
from store.agent_ids import agent_key
from store.backend import BlockBackend
from store.disk import MANIFEST, DiskStore
from store.redis_store import RedisStore
from tests.store.conftest import assert_same_cache, make_cache, tiny_spec, tokens

pytestmark = pytest.mark.integration

PREFIX = tokens(64, seed=42)  # 4 full blocks of tiny_spec: stored once, shared by every agent with them
Opener = Callable[..., BlockBackend]


@pytest.fixture(params=["disk", "redis-server"])
def opener(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Opener]:
    made: list[BlockBackend] = []

    def open_one(**options: Any) -> BlockBackend:
        store: BlockBackend
        if request.param == "disk":
            store = DiskStore(tmp_path / "store", tiny_spec(), **options)
        else:
            store = RedisStore(request.getfixturevalue("redis_url"), tiny_spec(), **options)
        made.append(store)
        return store

    yield open_one
    for store in made:
        store.close()


def outlive_ttl(store: BlockBackend, agents: list[str], seconds: float = 2.5) -> None:
    """Let the agents go unused for `seconds` (disk: their manifests' mtime; Redis: wait, keys expire)."""
    if not isinstance(store, DiskStore):
        time.sleep(seconds)
        return
    past = time.time() - seconds
    for agent in agents:
        path = store._dir(agent_key(agent)) / MANIFEST
        if path.exists():
            os.utime(path, (past, past))


def test_ttl_expires_unused_agents_and_get_extends_it(opener: Opener) -> None:
    """Each use restarts an agent's TTL (disk: its manifest's mtime; Redis: its keys' expiry)."""
    store = opener(ttl_s=2)
    store.put("a", make_cache(store.spec, tokens(40)))
    store.put("b", make_cache(store.spec, tokens(40, seed=1)))
    time.sleep(1.2)
    assert store.get("a") is not None  # refreshes a's expiry
    time.sleep(1.2)
    assert store.get("b") is None  # b was not used: gone
    assert store.get("a") is not None
    assert store.list() == ["a"]  # the index forgets expired agents


def test_list_leaves_out_agents_past_their_ttl_unless_pinned(opener: Opener) -> None:
    """list, written once over what the budget sees, names no expired agent even before a get."""
    store = opener(ttl_s=1)
    store.put("pinned", make_cache(store.spec, tokens(20, seed=1)))
    store.put("stale", make_cache(store.spec, tokens(20, seed=2)))
    assert store.pin("pinned")
    outlive_ttl(store, ["pinned", "stale"])
    store.put("fresh", make_cache(store.spec, tokens(20, seed=3)))
    assert store.list() == ["fresh", "pinned"]
    assert store.info("stale") is None


def test_a_pinned_agent_is_never_evicted_by_the_budget(opener: Opener) -> None:
    probe = opener()
    probe.put("probe", make_cache(probe.spec, tokens(20)))
    size = probe.info("probe").nbytes  # type: ignore[union-attr]
    probe.delete("probe")
    store = opener(max_bytes=int(2.5 * size))
    for agent in ("a", "b"):
        store.put(agent, make_cache(store.spec, tokens(20, seed=ord(agent))))
        time.sleep(0.01)
    assert store.pin("a")  # the least recently used
    store.put("c", make_cache(store.spec, tokens(20, seed=3)))
    assert store.list() == ["a", "c"]  # b went instead
    store.put("d", make_cache(store.spec, tokens(20, seed=4)))
    assert store.list() == ["a", "d"]
    assert store.unpin("a") and not store.unpin("a")
    time.sleep(0.01)
    store.put("e", make_cache(store.spec, tokens(20, seed=5)))
    assert store.list() == ["d", "e"]  # unpinned, it is the oldest again


def test_a_pinned_agent_and_the_shared_blocks_it_uses_outlive_the_ttl(opener: Opener) -> None:
    store = opener(ttl_s=1)
    pinned = make_cache(store.spec, PREFIX + tokens(10, seed=1))
    store.put("pinned", pinned)
    store.put("other", make_cache(store.spec, PREFIX + tokens(10, seed=2)))
    store.put("loose", make_cache(store.spec, tokens(20, seed=3)))
    assert store.pin("pinned")
    store.put("other", make_cache(store.spec, PREFIX + tokens(12, seed=2)))  # its put re-arms the TTLs
    outlive_ttl(store, ["pinned", "other", "loose"])
    assert store.get("loose") is None and store.get("other") is None
    assert_same_cache(store.get("pinned"), pinned)  # its own blocks and the shared prefix
    info = store.info("pinned")
    assert info is not None and info.pinned and info.shared_blocks == 4
    assert store.unpin("pinned")
    outlive_ttl(store, ["pinned"])
    assert store.get("pinned") is None


def test_delete_removes_an_agents_blocks_and_leaves_shared_ones_to_their_other_users(opener: Opener) -> None:
    store = opener()
    first, second = (make_cache(store.spec, PREFIX + tokens(10, seed=i)) for i in (1, 2))
    store.put("first", first)
    store.put("second", second)
    assert store.pin("first")
    assert store.delete("first")  # a pinned agent is deleted too, when asked
    assert store.info("first") is None and not store.delete("first")
    assert_same_cache(store.get("second"), second)
    if isinstance(store, DiskStore):
        assert not store._dir(agent_key("first")).exists()
    else:
        assert isinstance(store, RedisStore)
        assert list(store._client.scan_iter(match=f"{store.prefix}{agent_key('first')}:*")) == []
        assert not store._client.sismember(store.keys.pinned, "first")


def test_pin_needs_a_stored_agent_and_a_valid_id(opener: Opener) -> None:
    store = opener()
    assert not store.pin("nobody") and not store.unpin("nobody")
    with pytest.raises(InvalidAgentIdError):
        store.pin("")
    store.put("a", make_cache(store.spec, tokens(20)))
    info = store.info("a")
    assert info is not None and not info.pinned and info.shared_blocks == 1  # 20 tokens: one full block
