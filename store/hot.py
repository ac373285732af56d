"""The hot tier: recently used caches kept in worker memory, writes sent to the backend behind.

An agent that comes back to the same worker is served from memory (no I/O, no
decode). `put` returns at once with a Future that resolves once the cache is durable
in the backend: a background thread writes the newest cache of each agent (an agent
put twice before its write is written once; the older put's future follows the newer
one). Pending writes are bounded: past `max_pending_bytes` a put waits for the writer,
so a slow backend cannot grow memory without limit. `close()` (and, as a safety net,
interpreter exit) flushes every pending write. `prefetch` runs a `get` on a background
thread so the caller's thread never waits on store I/O or decoding. Anonymous prefixes pass
through: `prefetch_prefix` reads on the same threads, `put_prefix` writes behind on a thread of
its own (best effort: past the pending bound a prefix put is dropped, never waited for).

The tier keeps caches exactly as they were put: quantization applies at rest, in the
backend. Entries are evicted least recently used first once they exceed the byte
budget; that is logged and counted, and never drops a write that is still pending.
Callers must not modify a cache's arrays after putting it or while using one got.

Why one class of ~440 lines: it is the whole CacheStore protocol in front of a backend, and every
call has to see memory, the pending writes and the backend together under one lock (a get must
never miss a cache that is only pending, a delete must cancel its pending write).
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
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import numpy as np

from engine.core.blocks import AgentCache
from producer.wire.ids import validate_agent_id
from store.backend import BlockBackend, check_fence
from store.base import CacheInfo, Stats, log, shared_prefix
from store.errors import NO_COMMON_PREFIX, StoreError

HOT_COUNTERS = (
    "hot_hits",
    "hot_misses",
    "hot_evictions",
    "hot_evicted_bytes",
    "writes_behind",
    "write_errors",
    "prefetches",
    "prefix_puts_dropped",
)
PREFETCH_THREADS = 2


@dataclass
class _Write:
    """A cache waiting for the backend, with the futures of every put it answers for."""

    cache: AgentCache
    fence: int | None
    futures: list[Future[bool]] = field(default_factory=list)
    namespace: str = ""


def _running_future() -> Future[bool]:
    future: Future[bool] = Future()
    future.set_running_or_notify_cancel()  # a caller cannot cancel a write: cancel() returns False
    return future


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
        self._spaces: dict[str, str] = {}  # agent -> the namespace its in-memory cache was put or read in
        self._lru_bytes = 0
        self._pending: OrderedDict[str, _Write] = OrderedDict()
        self._pending_bytes = 0
        self._inflight: dict[str, _Write] = {}
        self._epoch = 0  # bumped by every put/delete: a slow backend read must not overwrite newer data
        # agent -> the fence its in-memory cache is fresh as of (its own put's, or the turn that read it):
        # another worker's later turn (a higher fence) may have written a newer cache to the backend.
        self._fresh_as_of: dict[str, int] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._writer: threading.Thread | None = None
        self._prefetcher: ThreadPoolExecutor | None = None
        self._prefix_writer: ThreadPoolExecutor | None = None
        self._prefix_pending: dict[Future[bool], int] = {}  # unwritten prefix puts -> their bytes
        self._stats = Stats(HOT_COUNTERS)
        self._atexit = functools.partial(_close_at_exit, weakref.ref(self))
        atexit.register(self._atexit)

    # --- reads ---------------------------------------------------------------------------------
    def get(
        self,
        agent_id: str,
        *,
        prompt_tokens: Sequence[int] | None = None,
        fence: int | None = None,
        namespace: str | None = None,
    ) -> AgentCache | None:
        """The agent's cache. `fence`: the caller's turn (agent_turns); memory serves it only if it is
        at least as new as the previous turn's, else the backend is read (another worker wrote it).
        `namespace`: the tenant (None: the store's); memory serves only a cache of the same one."""
        validate_agent_id(agent_id)
        namespace = self.backend.effective_namespace(namespace)
        hit, cache, epoch = self._from_memory(agent_id, prompt_tokens, fence, namespace)
        if hit:
            return cache
        return self._from_backend(agent_id, prompt_tokens, epoch, fence, namespace)

    def prefetch(
        self,
        agent_id: str,
        *,
        prompt_tokens: Sequence[int] | None,
        fence: int | None = None,
        namespace: str | None = None,
    ) -> Future[AgentCache | None]:
        """`get(agent_id, prompt_tokens=...)` computed on a background thread.

        A hot-tier hit comes back as an already finished future; otherwise the backend read,
        checks and decode run on one of the store's prefetch threads. The future never
        carries an exception for stored data (a bad cache is a miss, None, as with `get`).
        Counted as one get: use its result instead of calling `get` again.
        """
        validate_agent_id(agent_id)
        namespace = self.backend.effective_namespace(namespace)
        prompt = None if prompt_tokens is None else list(prompt_tokens)  # the caller may reuse its list
        self._stats.add("prefetches")
        hit, cache, epoch = self._from_memory(agent_id, prompt, fence, namespace)
        if hit:
            done: Future[AgentCache | None] = Future()
            done.set_result(cache)
            return done
        return self._background().submit(self._from_backend, agent_id, prompt, epoch, fence, namespace)

    def _background(self) -> ThreadPoolExecutor:
        """The prefetch threads (started on first use)."""
        with self._cond:
            if self._closed:
                raise StoreError("prefetch on a closed store")
            if self._prefetcher is None:
                self._prefetcher = ThreadPoolExecutor(
                    PREFETCH_THREADS, thread_name_prefix="kvrq-store-prefetch"
                )
            return self._prefetcher

    def _from_memory(
        self, agent_id: str, prompt_tokens: Sequence[int] | None, fence: int | None, namespace: str
    ) -> tuple[bool, AgentCache | None, int]:
        """(hit, the get's result if hit, the epoch a backend read must compare against)."""
        with self._cond:
            cache = self._newest(agent_id)
            if cache is not None and fence is not None and self._fresh_as_of.get(agent_id, -1) < fence - 1:
                cache = None  # another worker's turn came between: its cache is in the backend
            if cache is not None and self._space_of(agent_id) != namespace:
                cache = None  # put in another namespace: the backend decides (a namespace_mismatch miss)
            if agent_id in self._lru:
                self._lru.move_to_end(agent_id)
            epoch = self._epoch
        if cache is None:
            self._stats.add("hot_misses")
            return False, None, epoch
        self._stats.add("hot_hits")
        return True, self._for_prompt(agent_id, cache, prompt_tokens), epoch

    def _from_backend(
        self,
        agent_id: str,
        prompt_tokens: Sequence[int] | None,
        epoch: int,
        fence: int | None,
        namespace: str,
    ) -> AgentCache | None:
        cache = self.backend.get(agent_id, prompt_tokens=prompt_tokens, namespace=namespace)
        with self._cond:
            if self._epoch == epoch:
                if cache is not None and not self._closed:
                    self._insert(agent_id, cache, namespace)
                    self._mark_fresh(agent_id, fence)
                return cache
            newer = self._newest(agent_id)  # put (or deleted) while we read: the newest wins
            if newer is not None and self._space_of(agent_id) != namespace:
                newer = None
        return cache if newer is None else self._for_prompt(agent_id, newer, prompt_tokens)

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
        write = self._pending.get(agent_id) or self._inflight.get(agent_id)
        return None if write is None else write.cache

    def _newest(self, agent_id: str) -> AgentCache | None:
        unwritten = self._unwritten(agent_id)
        return unwritten if unwritten is not None else self._lru.get(agent_id)

    def _space_of(self, agent_id: str) -> str | None:
        """The namespace of the agent's newest cache in memory (lock held)."""
        write = self._pending.get(agent_id) or self._inflight.get(agent_id)
        return write.namespace if write is not None else self._spaces.get(agent_id)

    # --- writes --------------------------------------------------------------------------------
    def put(
        self, agent_id: str, cache: AgentCache, *, fence: int | None = None, namespace: str | None = None
    ) -> Future[bool]:
        """Keep `cache` in memory and queue it for the backend; returns a Future of its durability.

        The future resolves True once the backend holds this cache or a newer put of the agent
        (any other worker's get sees it), False if the backend dropped it as stale (`fence`
        below the stored one) or a delete cancelled it, and with the write's exception if the
        backend write failed (logged, counted in `write_errors`). A put replaced by a newer put
        of the same agent before it was written resolves with that newer put's outcome. Raises
        only for a caller's bug: an invalid agent id or fence, a cache of another spec, a closed
        store. Done-callbacks run on the writer thread: keep them short, never wait on the store.
        """
        validate_agent_id(agent_id)
        check_fence(fence)
        namespace = self.backend.effective_namespace(namespace)
        cache.validate(self.spec)
        if self._closed:
            raise StoreError("put on a closed store")
        future = _running_future()
        write = _Write(cache, fence, [future], namespace)
        if not self.write_behind:
            stands = self._write(agent_id, write)
            with self._cond:
                if self._closed:
                    raise StoreError("put on a closed store")
                self._epoch += 1
                if stands:
                    self._insert(agent_id, cache, namespace)
                    self._mark_fresh(agent_id, fence)
            return future
        with self._cond:
            if self._closed:
                raise StoreError("put on a closed store")
            self._epoch += 1
            self._insert(agent_id, cache, namespace)
            self._mark_fresh(agent_id, fence)
            replaced = self._pending.get(agent_id)
            if replaced is not None:
                self._pending_bytes -= replaced.cache.nbytes
                write.futures[:0] = replaced.futures  # they now follow this put's outcome
            self._pending[agent_id] = write
            self._pending_bytes += cache.nbytes
            self._ensure_writer()
            self._cond.notify_all()
            while self._pending_bytes > self.max_pending_bytes and agent_id in self._pending:
                self._cond.wait()
        return future

    def _write(self, agent_id: str, write: _Write) -> bool:
        """Write to the backend and settle the futures; False when the backend dropped it as stale."""
        try:
            written = self.backend.put(agent_id, write.cache, fence=write.fence, namespace=write.namespace)
        except Exception as exc:
            self._stats.add("write_errors")
            log.exception("hot tier: writing agent %r to the %s store failed", agent_id, self.backend.kind)
            for future in write.futures:
                future.set_exception(exc)
            return True  # not durable, but not stale either: the cache stays in memory
        if written:
            if self.write_behind:
                self._stats.add("writes_behind")
        else:
            with self._cond:  # another worker holds the agent now: serve its cache, not ours
                self._forget(agent_id, write.cache)
        for future in write.futures:
            future.set_result(written)
        return written

    def _mark_fresh(self, agent_id: str, fence: int | None) -> None:
        """Record the turn the in-memory cache is fresh as of (lock held); unknown without a fence."""
        if fence is None:
            self._fresh_as_of.pop(agent_id, None)
        else:
            self._fresh_as_of[agent_id] = fence

    def _insert(self, agent_id: str, cache: AgentCache, namespace: str) -> None:
        """Put into the LRU and evict the least recently used beyond the budget (lock held)."""
        old = self._lru.pop(agent_id, None)
        if old is not None:
            self._lru_bytes -= old.nbytes
        self._spaces.pop(agent_id, None)
        if cache.nbytes > self.capacity_bytes:
            return
        self._lru[agent_id] = cache
        self._spaces[agent_id] = namespace
        self._lru_bytes += cache.nbytes
        while self._lru_bytes > self.capacity_bytes:
            victim, evicted = self._lru.popitem(last=False)
            self._fresh_as_of.pop(victim, None)
            self._spaces.pop(victim, None)
            self._lru_bytes -= evicted.nbytes
            self._stats.add("hot_evictions")
            self._stats.add("hot_evicted_bytes", evicted.nbytes)
            log.debug("hot tier: evicted agent %r (%d bytes) from memory", victim, evicted.nbytes)

    def _forget(self, agent_id: str, cache: AgentCache) -> None:
        """Drop `cache` from memory if it is still the agent's entry (lock held)."""
        if self._lru.get(agent_id) is cache:
            del self._lru[agent_id]
            self._spaces.pop(agent_id, None)
            self._lru_bytes -= cache.nbytes

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
                agent_id, write = self._pending.popitem(last=False)
                self._pending_bytes -= write.cache.nbytes
                self._inflight[agent_id] = write
                self._cond.notify_all()
            try:
                self._write(agent_id, write)  # resolves the futures before flush() can return
            finally:
                with self._cond:
                    self._inflight.pop(agent_id, None)
                    self._cond.notify_all()

    def flush(self) -> None:
        """Wait until every put so far (prefix puts too) is in the backend (or failed) and its future
        is resolved."""
        with self._cond:
            while self._pending or self._inflight:
                if self._writer is None or not self._writer.is_alive():
                    self._ensure_writer()
                self._cond.wait(timeout=1.0)
            prefixes = list(self._prefix_pending)
        wait(prefixes)

    # --- anonymous prefixes --------------------------------------------------------------------
    def get_prefix(self, prompt_tokens: Sequence[int], *, namespace: str | None = None) -> AgentCache | None:
        """The backend's longest stored run of full blocks of the prompt (not kept in memory)."""
        return self.backend.get_prefix(prompt_tokens, namespace=namespace)

    def prefetch_prefix(
        self, prompt_tokens: Sequence[int], *, namespace: str | None = None
    ) -> Future[AgentCache | None]:
        """`get_prefix` on one of the prefetch threads. The future never carries an exception for
        stored data or a failed read: those are misses (None), counted and logged."""
        namespace = self.backend.effective_namespace(namespace)
        prompt = list(prompt_tokens)  # the caller may reuse its list
        self._stats.add("prefetches")
        return self._background().submit(self._read_prefix, prompt, namespace)

    def _read_prefix(self, prompt_tokens: list[int], namespace: str) -> AgentCache | None:
        try:
            return self.backend.get_prefix(prompt_tokens, namespace=namespace)
        except Exception:  # never let a prefix read fail a job: prefill instead
            log.exception("hot tier: reading a prefix from the %s store failed", self.backend.kind)
            return None

    def put_prefix(self, cache: AgentCache, *, namespace: str | None = None) -> Future[bool]:
        """Hand the cache's full blocks to the backend's `put_prefix` behind, on a writer thread of
        its own; returns a Future of its result (with the write's exception if it failed, logged and
        counted in `write_errors`). Best effort: while unwritten prefix puts already hold
        `max_pending_bytes`, the put is dropped (`prefix_puts_dropped`, the future resolves False)
        rather than waited for. Raises only for a caller's bug (another spec, a closed store)."""
        namespace = self.backend.effective_namespace(namespace)
        cache.validate(self.spec)
        if not self.write_behind:
            if self._closed:
                raise StoreError("put_prefix on a closed store")
            done = _running_future()
            try:
                done.set_result(self._write_prefix(cache, namespace))
            except Exception as exc:
                done.set_exception(exc)
            return done
        with self._cond:
            if self._closed:
                raise StoreError("put_prefix on a closed store")
            pending = sum(self._prefix_pending.values())
            if self._prefix_pending and pending + cache.nbytes > self.max_pending_bytes:
                self._stats.add("prefix_puts_dropped")
                dropped = _running_future()
                dropped.set_result(False)
                return dropped
            if self._prefix_writer is None:
                self._prefix_writer = ThreadPoolExecutor(1, thread_name_prefix="kvrq-store-prefix-writer")
            future = self._prefix_writer.submit(self._write_prefix, cache, namespace)
            self._prefix_pending[future] = cache.nbytes
        future.add_done_callback(self._prefix_written)
        return future

    def _write_prefix(self, cache: AgentCache, namespace: str) -> bool:
        try:
            return self.backend.put_prefix(cache, namespace=namespace)
        except Exception:
            self._stats.add("write_errors")
            log.exception("hot tier: writing a prefix to the %s store failed", self.backend.kind)
            raise

    def _prefix_written(self, future: Future[bool]) -> None:
        with self._cond:
            self._prefix_pending.pop(future, None)
            self._cond.notify_all()

    # --- the rest of CacheStore ----------------------------------------------------------------
    def delete(self, agent_id: str) -> bool:
        """Delete the agent everywhere; its puts not yet written resolve False (never written)."""
        validate_agent_id(agent_id)
        with self._cond:
            self._epoch += 1
            held = self._lru.pop(agent_id, None)
            self._spaces.pop(agent_id, None)
            if held is not None:
                self._lru_bytes -= held.nbytes
            pending = self._pending.pop(agent_id, None)
            if pending is not None:
                self._pending_bytes -= pending.cache.nbytes
                self._cond.notify_all()
            while agent_id in self._inflight:
                self._cond.wait()
        if pending is not None:
            for future in pending.futures:
                future.set_result(False)
        return self.backend.delete(agent_id) or pending is not None

    def list(self) -> builtins.list[str]:
        with self._cond:
            unwritten = set(self._pending) | set(self._inflight)
        return sorted(set(self.backend.list()) | unwritten)

    def info(self, agent_id: str) -> CacheInfo | None:
        validate_agent_id(agent_id)
        with self._cond:
            cache = self._unwritten(agent_id)
            namespace = self._space_of(agent_id) or self.backend.namespace
        if cache is None:
            return self.backend.info(agent_id)
        return CacheInfo(
            agent_id,
            cache.n_tokens,
            cache.nbytes,
            time.time(),
            "none",
            len(cache.blocks),
            namespace=namespace,
        )

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
        """Flush pending writes, stop the writer and prefetches, close the backend. Safe to call twice."""
        with self._cond:
            if self._closed:
                return
        self.flush()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            prefetcher, self._prefetcher = self._prefetcher, None
            prefix_writer, self._prefix_writer = self._prefix_writer, None
        if self._writer is not None:
            self._writer.join()
        if prefix_writer is not None:
            prefix_writer.shutdown(wait=True)
        if prefetcher is not None:
            prefetcher.shutdown(wait=True, cancel_futures=True)
        atexit.unregister(self._atexit)
        self.backend.close()


def _close_at_exit(ref: weakref.ref[HotTierStore]) -> None:
    store = ref()
    if store is not None:
        store.close()
