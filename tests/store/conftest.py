"""Synthetic caches for the store tests: a small spec, and KV that depends only on the tokens
(benchmarks/caches.py's `make_cache` and `tokens`, which the store benchmarks use too)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fakeredis
import numpy as np
import pytest
from redis.exceptions import ResponseError

from benchmarks.caches import make_cache as make_cache  # the store tests import them from here
from benchmarks.caches import tokens as tokens
from engine.core.blocks import AgentCache
from engine.core.spec import LayerSpec, ModelCacheSpec
from store.backend import BlockBackend
from store.disk import DiskStore
from store.redis_store import RedisStore

BLOCK_TOKENS = 16


def tiny_spec(
    dtype: str = "float32", *, name: str = "tiny", layers: int = 3, block_tokens: int = BLOCK_TOKENS
) -> ModelCacheSpec:
    return ModelCacheSpec(
        model_name=name,
        n_layers=layers,
        layers=tuple(LayerSpec("full") for _ in range(layers)),
        n_kv_heads=2,
        k_head_dim=64,
        v_head_dim=64,
        dtype=dtype,
        block_tokens=block_tokens,
    )


def redis_value_keys(client: object, prefix: str, *, persistent_only: bool = False) -> set[str]:
    """Every block value a RedisStore keeps under `prefix`: agents' own (`<key>:b:<name>[:i]`) and
    shared ones (`s:<share>.<crc>[:i]`), not manifests, reference sets or pointers. With
    `persistent_only`, only values without an expiry (committed, not provisional)."""
    import re

    shape = re.compile(re.escape(prefix) + r"([0-9a-f]{40}:b:[0-9a-f.]+|s:[0-9a-f]{32}\.[0-9a-f]{8})(:\d+)?")
    keys = {k.decode() for k in client.scan_iter(match=f"{prefix}*")}  # type: ignore[attr-defined]
    found = {k for k in keys if shape.fullmatch(k)}
    if persistent_only:
        found = {k for k in found if client.pttl(k) == -1}  # type: ignore[attr-defined]
    return found


def assert_same_cache(got: AgentCache | None, expected: AgentCache) -> None:
    assert got is not None, "expected a hit"
    assert got.token_ids == expected.token_ids
    assert len(got.blocks) == len(expected.blocks)
    for a, b in zip(got.blocks, expected.blocks, strict=True):
        for x, y in zip(a.keys + a.values, b.keys + b.values, strict=True):
            assert x.dtype == y.dtype and x.shape == y.shape
            assert np.array_equal(x, y)


@pytest.fixture
def spec() -> ModelCacheSpec:
    return tiny_spec()


@pytest.fixture(params=["disk", "fakeredis"])
def backend_factory(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[Callable[..., DiskStore | RedisStore]]:
    """Builds backends of one kind over shared storage (one directory, one fake server)."""
    server = fakeredis.FakeServer()
    made: list[DiskStore | RedisStore] = []

    def factory(spec: ModelCacheSpec, **options: object) -> DiskStore | RedisStore:
        store: DiskStore | RedisStore
        if request.param == "disk":
            store = DiskStore(tmp_path / "store", spec, **options)  # type: ignore[arg-type]
        else:
            store = RedisStore(fakeredis.FakeRedis(server=server), spec, **options)  # type: ignore[arg-type]
        made.append(store)
        return store

    factory.kind = request.param  # type: ignore[attr-defined]
    yield factory
    for store in made:
        store.close()


@pytest.fixture(params=[pytest.param("redis-server", marks=pytest.mark.integration), "fakeredis"])
def store_and_rival(request: pytest.FixtureRequest) -> Iterator[tuple[RedisStore, RedisStore]]:
    """Our RedisStore and a rival writer on the same server: a real redis-server, or fakeredis (which runs
    no Lua here, so the paths without scripts)."""
    if request.param == "fakeredis":
        server = fakeredis.FakeServer()
        stores = [RedisStore(fakeredis.FakeRedis(server=server), tiny_spec(), prefix="race:") for _ in (1, 2)]
    else:
        url = request.getfixturevalue("redis_url")
        stores = [RedisStore(url, tiny_spec(), prefix="race:") for _ in (1, 2)]
    yield stores[0], stores[1]
    for store in stores:
        store.close()


def without_scripting(store: RedisStore) -> RedisStore:
    """The store as on a server that runs no Lua (EVAL disabled or renamed, fakeredis without lupa):
    its client's EVAL answers as such a server does, so it takes its WATCH/MULTI paths instead."""

    def refused(*_args: object, **_kwargs: object) -> None:
        raise ResponseError("unknown command 'eval', with args beginning with: ")

    store._client.eval = refused  # type: ignore[method-assign]
    return store


@contextlib.contextmanager
def backends_of_kind(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[Callable[..., BlockBackend]]:
    """Opens backends of one kind over one storage (one directory, one Redis server), as several
    workers would, and closes them after: `disk`, `fakeredis`, `redis-server` (a real one), and
    `redis-server-without-scripts` (which takes the fallbacks for servers without Lua)."""
    made: list[BlockBackend] = []
    server = fakeredis.FakeServer()

    def open_one(namespace: str = "default", **options: Any) -> BlockBackend:
        backend: BlockBackend
        if kind == "disk":
            backend = DiskStore(tmp_path / "store", tiny_spec(), namespace=namespace, **options)
        elif kind == "fakeredis":
            client = fakeredis.FakeRedis(server=server)
            backend = RedisStore(client, tiny_spec(), namespace=namespace, **options)
        else:
            url = request.getfixturevalue("redis_url")
            backend = RedisStore(url, tiny_spec(), namespace=namespace, **options)
            if kind == "redis-server-without-scripts":
                without_scripting(backend)
        made.append(backend)
        return backend

    try:
        yield open_one
    finally:
        for backend in made:
            backend.close()
