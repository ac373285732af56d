"""The hot tier: recently used caches kept in worker memory, writes sent to the backend behind.

An agent that comes back to the same worker is served from memory (no I/O, no
decode). `put` returns at once: a background thread writes the newest cache of each
agent to the backend (an agent put twice before its write is written once). Pending
writes are bounded: past `max_pending_bytes` a put waits for the writer, so a slow
backend cannot grow memory without limit. `close()` (and, as a safety net, interpreter
exit) flushes every pending write.

The tier keeps caches exactly as they were put: quantization applies at rest, in the
backend. Entries are evicted least recently used first once they exceed the byte
budget; that is logged and counted, and never drops a write that is still pending.
Callers must not modify a cache's arrays after putting it or while using one got.
"""

from __future__ import annotations

import atexit
import builtins
import functools
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from engine.blocks import AgentCache
from store.agent_ids import validate_agent_id
from store.backend import BlockBackend
from store.base import CacheInfo, Stats, log, shared_prefix
from store.errors import NO_COMMON_PREFIX, StoreError

HOT_COUNTERS = (
    "hot_hits",
    "hot_misses",
    "hot_evictions",
    "hot_evicted_bytes",
    "writes_behind",
    "write_errors",
)


class HotTierStore:
    """A CacheStore: an in-memory LRU (by bytes) with write-behind in front of a backend."""

    def __init__(
        self,
        backend: BlockBackend,
        capacity_bytes: int,
        *,
        write_behind: bool = True,
        max_pending_bytes: int | None = None,
    ) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.backend = backend
        self.spec = backend.spec
        self.capacity_bytes = capacity_bytes
        self.write_behind = write_behind
        # By default unwritten caches may take as much memory as the tier itself (at least one cache).
        self.max_pending_bytes = max(capacity_bytes, 1) if max_pending_bytes is None else max_pending_bytes
        self._lru: OrderedDict[str, AgentCache] = OrderedDict()
        self._lru_bytes = 0
        self._pending: OrderedDict[str, AgentCache] = OrderedDict()
        self._pending_bytes = 0
        self._inflight: dict[str, AgentCache] = {}
        self._epoch = 0  # bumped by every put/delete: a slow backend read must not overwrite newer data
        self._cond = threading.Condition()
        self._closed = False
        self._writer: threading.Thread | None = None
        self._stats = Stats(HOT_COUNTERS)
        self._atexit = functools.partial(_close_at_exit, weakref.ref(self))
        atexit.register(self._atexit)

    # --- reads ---------------------------------------------------------------------------------
    def get(self, agent_id: str, *, prompt_tokens: Sequence[int] | None = None) -> AgentCache | None:
        validate_agent_id(agent_id)
        with self._cond:
            cache = self._newest(agent_id)
            if agent_id in self._lru:
                self._lru.move_to_end(agent_id)
            epoch = self._epoch
        if cache is not None:
            self._stats.add("hot_hits")
            return self._for_prompt(agent_id, cache, prompt_tokens)
        self._stats.add("hot_misses")
        cache = self.backend.get(agent_id, prompt_tokens=prompt_tokens)
        if cache is not None:
            with self._cond:
                if self._epoch == epoch and not self._closed:
                    self._insert(agent_id, cache)
        return cache

    def _for_prompt(
        self, agent_id: str, cache: AgentCache, prompt_tokens: Sequence[int] | None
    ) -> AgentCache | None:
        if prompt_tokens is None:
            return cache
        n = shared_prefix(np.asarray(cache.token_ids, dtype=np.int64), prompt_tokens)
        if n == 0 and cache.n_tokens > 0:
            self.backend.record_miss(agent_id, NO_COMMON_PREFIX, "the prompt shares no token (hot tier)")
            return None
        return cache if n == cache.n_tokens else cache.truncated(n)

    def _unwritten(self, agent_id: str) -> AgentCache | None:
        """The newest cache put but not yet in the backend (lock held)."""
        pending = self._pending.get(agent_id)
        return pending if pending is not None else self._inflight.get(agent_id)

    def _newest(self, agent_id: str) -> AgentCache | None:
        unwritten = self._unwritten(agent_id)
        return unwritten if unwritten is not None else self._lru.get(agent_id)

    # --- writes --------------------------------------------------------------------------------
    def put(self, agent_id: str, cache: AgentCache) -> None:
        """Keep `cache` in memory and queue it for the backend; raises if it does not fit the spec."""
        validate_agent_id(agent_id)
        cache.validate(self.spec)
        if self._closed:
            raise StoreError("put on a closed store")
        if not self.write_behind:
            self.backend.put(agent_id, cache)
        with self._cond:
            if self._closed:
                raise StoreError("put on a closed store")
            self._epoch += 1
            self._insert(agent_id, cache)
            if not self.write_behind:
                return
            old = self._pending.get(agent_id)
            if old is not None:
                self._pending_bytes -= old.nbytes
            self._pending[agent_id] = cache
            self._pending_bytes += cache.nbytes
            self._ensure_writer()
            self._cond.notify_all()
            while self._pending_bytes > self.max_pending_bytes and agent_id in self._pending:
                self._cond.wait()

    def _insert(self, agent_id: str, cache: AgentCache) -> None:
        """Put into the LRU and evict the least recently used beyond the budget (lock held)."""
        old = self._lru.pop(agent_id, None)
        if old is not None:
            self._lru_bytes -= old.nbytes
        if cache.nbytes > self.capacity_bytes:
            return
        self._lru[agent_id] = cache
        self._lru_bytes += cache.nbytes
        while self._lru_bytes > self.capacity_bytes:
            victim, evicted = self._lru.popitem(last=False)
            self._lru_bytes -= evicted.nbytes
            self._stats.add("hot_evictions")
            self._stats.add("hot_evicted_bytes", evicted.nbytes)
            log.debug("hot tier: evicted agent %r (%d bytes) from memory", victim, evicted.nbytes)

    def _ensure_writer(self) -> None:
        if self._writer is None or not self._writer.is_alive():
            self._writer = threading.Thread(target=self._write_loop, name="kvrq-store-writer", daemon=True)
            self._writer.start()

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending:
                    return
                agent_id, cache = self._pending.popitem(last=False)
                self._pending_bytes -= cache.nbytes
                self._inflight[agent_id] = cache
                self._cond.notify_all()
            try:
                self.backend.put(agent_id, cache)
                self._stats.add("writes_behind")
            except Exception:
                self._stats.add("write_errors")
                log.exception(
                    "hot tier: writing agent %r to the %s store failed", agent_id, self.backend.kind
                )
            finally:
                with self._cond:
                    self._inflight.pop(agent_id, None)
                    self._cond.notify_all()

    def flush(self) -> None:
        """Wait until every put so far is in the backend."""
        with self._cond:
            while self._pending or self._inflight:
                if self._writer is None or not self._writer.is_alive():
                    self._ensure_writer()
                self._cond.wait(timeout=1.0)

    # --- the rest of CacheStore ----------------------------------------------------------------
    def delete(self, agent_id: str) -> bool:
        validate_agent_id(agent_id)
        with self._cond:
            self._epoch += 1
            held = self._lru.pop(agent_id, None)
            if held is not None:
                self._lru_bytes -= held.nbytes
            pending = self._pending.pop(agent_id, None)
            if pending is not None:
                self._pending_bytes -= pending.nbytes
                self._cond.notify_all()
            while agent_id in self._inflight:
                self._cond.wait()
        return self.backend.delete(agent_id) or pending is not None

    def list(self) -> builtins.list[str]:
        with self._cond:
            unwritten = set(self._pending) | set(self._inflight)
        return sorted(set(self.backend.list()) | unwritten)

    def info(self, agent_id: str) -> CacheInfo | None:
        validate_agent_id(agent_id)
        with self._cond:
            cache = self._unwritten(agent_id)
        if cache is None:
            return self.backend.info(agent_id)
        return CacheInfo(agent_id, cache.n_tokens, cache.nbytes, time.time(), "none", len(cache.blocks))

    def stats(self) -> dict[str, int]:
        with self._cond:
            gauges = {
                "hot_entries": len(self._lru),
                "hot_bytes": self._lru_bytes,
                "pending_writes": len(self._pending) + len(self._inflight),
                "pending_bytes": self._pending_bytes,
            }
        return {**self.backend.stats(), **self._stats.snapshot(), **gauges}

    def close(self) -> None:
        """Flush pending writes, stop the writer, close the backend. Safe to call twice."""
        with self._cond:
            if self._closed:
                return
        self.flush()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._writer is not None:
            self._writer.join()
        atexit.unregister(self._atexit)
        self.backend.close()


def _close_at_exit(ref: weakref.ref[HotTierStore]) -> None:
    store = ref()
    if store is not None:
        store.close()
