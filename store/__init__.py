"""kvrq's KV cache store: agents' caches on disk or in Redis (one or sharded), behind a hot tier.

Entry point: `open_store(uri, spec, ...)`. Format: docs/store-format.md.
"""

from producer.wire.ids import InvalidAgentIdError, validate_agent_id
from store.base import CacheInfo, CacheStore
from store.disk import DiskStore
from store.errors import BadCacheError, StoreError
from store.factory import open_backend, open_for_admin, open_store
from store.hot import HotTierStore
from store.redis_store import RedisStore
from store.sharded import ShardedStore

__all__ = [
    "BadCacheError",
    "CacheInfo",
    "CacheStore",
    "DiskStore",
    "HotTierStore",
    "InvalidAgentIdError",
    "RedisStore",
    "ShardedStore",
    "StoreError",
    "open_backend",
    "open_for_admin",
    "open_store",
    "validate_agent_id",
]
