"""The sharded store on three real redis-server processes, through the worker's own entry points:
open_store with a `shards:` URL and producer's connect, `kvrq cache`, shared blocks once per shard,
and one server killed: its agents are counted misses and failed writes, the others' unaffected."""

from __future__ import annotations

import argparse
import io
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.exceptions import RedisError

from producer.wire.redis_url import connect
from store.factory import open_store
from store.hot import HotTierStore
from store.sharded import ShardedStore
from tests.conftest import RedisServer
from tests.store.conftest import assert_same_cache, make_cache, tiny_spec, tokens
from worker.cli.cache import run_cache_command

pytestmark = pytest.mark.integration

POINTER = re.compile(rb"kvrq:cache:s:[0-9a-f]{32}")  # a stored shared block's pointer (one per block)
SYSTEM = tokens(64, seed=5)  # 4 full blocks every agent's prompt starts with


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[list[RedisServer]]:
    started = []
    try:
        for index in range(3):
            (tmp_path / str(index)).mkdir()
            server = RedisServer(tmp_path / str(index))
            server.start()
            started.append(server)
        yield started
    finally:
        for server in started:
            server.stop(kill=True)


def shards_url(servers: list[RedisServer]) -> str:
    return "shards:" + "|".join(server.url for server in servers)


def open_sharded(servers: list[RedisServer]) -> HotTierStore:
    """As a worker opens it (no hot tier: every read goes to the shards)."""
    return open_store(shards_url(servers), tiny_spec(), hot_tier_bytes=0, connect=connect, write_behind=False)


def test_agents_live_on_their_shard_and_kvrq_cache_sees_them_all(servers: list[RedisServer]) -> None:
    store = open_sharded(servers)
    backend = store.backend
    assert isinstance(backend, ShardedStore)
    agents = [f"agent-{i}" for i in range(12)]
    caches = {a: make_cache(store.spec, SYSTEM + tokens(20, seed=i)) for i, a in enumerate(agents)}
    try:
        for agent, cache in caches.items():
            assert store.put(agent, cache).result(timeout=30)
        clients = [redis.Redis.from_url(server.url) for server in servers]
        for agent, cache in caches.items():
            home = backend.shard_index(agent)
            held = [bool(c.zscore("kvrq:cache:index", agent)) for c in clients]
            assert held == [i == home for i in range(3)]
            assert_same_cache(store.get(agent, prompt_tokens=cache.token_ids), cache)
        # Shared blocks: the system prompt's 4 blocks once on each shard that holds an agent (not once per
        # agent), plus each agent's own 5th full block (its first 16 tokens after the system prompt).
        for index, client in enumerate(clients):
            pointers = [k for k in client.scan_iter(match="kvrq:cache:s:*") if POINTER.fullmatch(k)]
            users = sum(1 for a in agents if backend.shard_index(a) == index)
            assert len(pointers) == (4 + users if users else 0), (index, users)
    finally:
        store.close()

    out, err = io.StringIO(), io.StringIO()
    listing = argparse.Namespace(store=shards_url(servers), action="list", namespace=None)
    assert run_cache_command(listing, out, err) == 0, err.getvalue()
    assert "12 agent(s)" in out.getvalue()
    assert all(agent in out.getvalue() for agent in agents)
    deleting = argparse.Namespace(store=shards_url(servers), action="delete", agents=agents[:2])
    assert run_cache_command(deleting, out, err) == 0, err.getvalue()
    out = io.StringIO()
    assert run_cache_command(listing, out, err) == 0
    assert "10 agent(s)" in out.getvalue() and "agent-0 " not in out.getvalue()


def test_a_dead_shard_is_a_counted_miss_for_its_agents_only(servers: list[RedisServer]) -> None:
    store = open_sharded(servers)
    backend = store.backend
    assert isinstance(backend, ShardedStore)
    agents = [f"agent-{i}" for i in range(12)]
    caches = {a: make_cache(store.spec, SYSTEM + tokens(20, seed=i)) for i, a in enumerate(agents)}
    try:
        for agent, cache in caches.items():
            assert store.put(agent, cache).result(timeout=30)
        dead = backend.shard_index(agents[0])
        servers[dead].stop(kill=True)
        on_dead = [a for a in agents if backend.shard_index(a) == dead]
        for agent, cache in caches.items():
            got = store.get(agent, prompt_tokens=cache.token_ids)
            if agent in on_dead:
                assert got is None
            else:
                assert_same_cache(got, cache)
        stats = store.stats()
        assert stats["miss_backend_error"] == len(on_dead)
        assert stats["hits"] == len(agents) - len(on_dead)
        # Writes: the dead shard's fail (counted, raised to the caller's future), the others' land.
        for agent in agents:
            future = store.put(agent, caches[agent])
            if agent in on_dead:
                with pytest.raises(RedisError):
                    future.result(timeout=30)
            else:
                assert future.result(timeout=30)
        assert store.stats()["write_errors"] == len(on_dead)
    finally:
        store.close()
