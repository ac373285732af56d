"""open_store: the one call a worker makes to get its CacheStore from a URI and options."""

from __future__ import annotations

import re
from pathlib import Path

from engine.core.spec import ModelCacheSpec
from producer.wire.redis_url import DEFAULT_REDIS_URL
from store.backend import DEFAULT_NAMESPACE, DEFAULT_PREFIX_BYTES, BackendOptions, BlockBackend
from store.disk import MARKER, DiskStore
from store.errors import StoreError
from store.hot import HotTierStore
from store.quant import Quantization
from store.redis_store import DEFAULT_PREFIX, Connect, RedisStore
from store.shard_url import is_sharded_uri, parse_shards, redact
from store.sharded import ShardedStore

MiB = 1024 * 1024
DEFAULT_HOT_TIER_BYTES = 512 * MiB
#: URL forms of a Redis store; the Sentinel ones need `connect` (the worker passes producer.wire.redis_url's).
REDIS_SCHEMES = ("redis://", "rediss://", "unix://", "redis+sentinel://", "rediss+sentinel://")


def open_backend(
    uri: str,
    spec: ModelCacheSpec,
    *,
    max_bytes: int | None = None,
    quantization: Quantization = "none",
    group_size: int = 64,
    ttl_s: int | None = None,
    prefix: str = DEFAULT_PREFIX,
    namespace: str = DEFAULT_NAMESPACE,
    connect: Connect | None = None,
    prefix_max_bytes: int | None = None,
) -> BlockBackend:
    """The backend named by `uri`, without a hot tier: `disk:PATH`, `redis`, `redis://...`,
    `redis+sentinel://...`, `shards:URL|URL|...`; `connect(url, **pool_options)` makes a Redis client
    (RedisStore). A sharded store splits `max_bytes` and `prefix_max_bytes` evenly over its shards."""
    if is_sharded_uri(uri):
        shards = parse_shards(uri)
        count = len(shards)
        if prefix_max_bytes is None and max_bytes is None:
            prefix_max_bytes = DEFAULT_PREFIX_BYTES
        parts = [
            open_backend(
                shard.url,
                spec,
                max_bytes=None if max_bytes is None else max(1, max_bytes // count),
                prefix_max_bytes=None if prefix_max_bytes is None else prefix_max_bytes // count,
                quantization=quantization,
                group_size=group_size,
                ttl_s=ttl_s,
                prefix=prefix,
                namespace=namespace,
                connect=connect,
            )
            for shard in shards
        ]
        return ShardedStore(parts, [shard.name for shard in shards])
    options = BackendOptions(
        quantization=quantization,
        group_size=group_size,
        max_bytes=max_bytes,
        namespace=namespace,
        prefix_max_bytes=prefix_max_bytes,
    )
    if uri.startswith("disk:"):
        path = uri.removeprefix("disk:")
        if not path:
            raise ValueError("disk store URI needs a path: disk:PATH")
        return DiskStore(path, spec, ttl_s=ttl_s, **options)
    if uri == "redis":
        uri = DEFAULT_REDIS_URL
    if uri.startswith(REDIS_SCHEMES):
        if connect is None and "+sentinel://" in uri:
            raise ValueError("a Sentinel store URL needs a connect function (the worker passes one)")
        return RedisStore(uri, spec, ttl_s=ttl_s, prefix=prefix, connect=connect, **options)
    shown = re.sub(r"//.*@", "//***@", redact(uri))  # a mistyped Redis URL may hold a password: never echo it
    raise ValueError(
        f"unknown store URI {shown!r}: use disk:PATH, redis, redis://HOST:PORT/DB, redis+sentinel://... "
        "or shards:URL|URL|..."
    )


#: The spec of a backend opened to administer caches (list, info, delete, pin, unpin): those read
#: manifests only, never KV, so they need no model. get and put refuse every cache with it.
ADMIN_SPEC = ModelCacheSpec(
    model_name="(cache administration)",
    n_layers=0,
    layers=(),
    n_kv_heads=0,
    k_head_dim=0,
    v_head_dim=0,
    dtype="float32",
)


def open_for_admin(uri: str, *, prefix: str = DEFAULT_PREFIX, connect: Connect | None = None) -> BlockBackend:
    """The backend named by `uri` for `kvrq cache` and programs: list, info, delete, pin, unpin.

    A disk path that holds no kvrq store is refused (StoreError) rather than created.
    """
    if uri.startswith("disk:"):
        path = Path(uri.removeprefix("disk:")).expanduser()
        if not (path / MARKER).is_file():
            raise StoreError(f"no kvrq store at {path} (no {MARKER}): check --store")
    return open_backend(uri, ADMIN_SPEC, prefix=prefix, connect=connect)


def open_store(
    uri: str,
    spec: ModelCacheSpec,
    *,
    hot_tier_bytes: int = DEFAULT_HOT_TIER_BYTES,
    max_bytes: int | None = None,
    quantization: Quantization = "none",
    group_size: int = 64,
    ttl_s: int | None = None,
    prefix: str = DEFAULT_PREFIX,
    write_behind: bool = True,
    namespace: str = DEFAULT_NAMESPACE,
    connect: Connect | None = None,
    prefix_max_bytes: int | None = None,
) -> HotTierStore:
    """The store for `uri` behind a hot tier of `hot_tier_bytes` (0 keeps nothing in memory).

    `max_bytes` bounds the backend (least recently used agents are evicted first);
    `quantization` ("none", "q8", "q4", MLX affine with `group_size`) applies at rest;
    `ttl_s` expires an agent's cache that long after its last use; `prefix` namespaces
    Redis keys; `namespace` is the tenant: full blocks are stored once per namespace and an
    agent can warm-start from another agent's prefix only within it; `prefix_max_bytes`
    bounds the blocks held for jobs without an agent (`put_prefix`; default a quarter of
    `max_bytes`, or 1 GiB without it; 0: none). Call `close()` on shutdown: it flushes the
    writes still pending.
    """
    backend = open_backend(
        uri,
        spec,
        max_bytes=max_bytes,
        quantization=quantization,
        group_size=group_size,
        ttl_s=ttl_s,
        prefix=prefix,
        namespace=namespace,
        connect=connect,
        prefix_max_bytes=prefix_max_bytes,
    )
    return HotTierStore(backend, hot_tier_bytes, write_behind=write_behind)
