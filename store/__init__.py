"""kvrq's KV cache store: agents' caches as safetensors on disk or in Redis, behind a hot tier.

Entry point: `open_store(uri, spec, ...)`. Format: docs/store-format.md.
"""

from store.agent_ids import InvalidAgentIdError, validate_agent_id
from store.base import CacheInfo, CacheStore
from store.disk import DiskStore
from store.errors import BadCacheError, StoreError
from store.factory import open_backend, open_for_admin, open_store
from store.hot import HotTierStore
from store.redis_store import RedisStore

__all__ = [
    "BadCacheError",
    "CacheInfo",
    "CacheStore",
    "DiskStore",
    "HotTierStore",
    "InvalidAgentIdError",
    "RedisStore",
    "StoreError",
    "open_backend",
    "open_for_admin",
    "open_store",
    "validate_agent_id",
]
