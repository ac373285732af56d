"""The CacheStore protocol the worker programs against, and what every backend shares.

`get` never raises for bad stored data: absent, corrupt and other-model caches are
all misses (None), each logged with the agent id and reason and counted in `stats()`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from engine.core.blocks import AgentCache
from store.errors import ABSENT, MISS_REASONS, NAMESPACE_MISMATCH, NO_COMMON_PREFIX

log = logging.getLogger("kvrq.store")


@dataclass(frozen=True)
class CacheInfo:
    """What `info` reports about one stored agent cache."""

    agent_id: str
    n_tokens: int
    nbytes: int  # bytes the cache takes in this store (at rest: after quantization)
    last_used: float  # unix time of the last get or put
    quantization: str
    n_blocks: int
    shared_blocks: int = (
        0  # of n_blocks: full blocks, in the shared area (once for all agents with those tokens)
    )
    pinned: bool = False  # never evicted by the store's budget or TTL (`kvrq cache pin`)
    namespace: str = ""  # the tenant whose shared area holds its full blocks ("": not recorded)


@runtime_checkable
class CacheStore(Protocol):
    def get(
        self, agent_id: str, *, prompt_tokens: Sequence[int] | None = None, namespace: str | None = None
    ) -> AgentCache | None:
        """The agent's cache, or None on a miss (absent, corrupt, another spec, another namespace).

        With `prompt_tokens`, only the longest prefix shared with that prompt is returned (and only
        its blocks are read); None if nothing is shared. `namespace`: the tenant whose shared blocks
        the call may use (None: the store's own); a cache stored by another namespace is a miss.
        """
        ...

    def put(
        self, agent_id: str, cache: AgentCache, *, fence: int | None = None, namespace: str | None = None
    ) -> object:
        """Store the cache. Backends return whether it was written (False: a stale fence);
        the hot tier returns a Future of that, resolved once the write is durable."""
        ...

    def get_prefix(self, prompt_tokens: Sequence[int], *, namespace: str | None = None) -> AgentCache | None:
        """The longest run of full blocks of the prompt that any job of the namespace stored, or None."""
        ...

    def put_prefix(self, cache: AgentCache, *, namespace: str | None = None) -> object:
        """Offer the cache's full blocks to later jobs of the namespace, without an agent (LRU budget).
        Backends return whether anything is held; the hot tier a Future of that."""
        ...

    def delete(self, agent_id: str) -> bool: ...

    def list(self) -> list[str]: ...

    def info(self, agent_id: str) -> CacheInfo | None: ...

    def stats(self) -> dict[str, int]: ...

    def close(self) -> None: ...


class Stats:
    """Thread-safe named counters."""

    def __init__(self, names: Sequence[str] = ()) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = dict.fromkeys(names, 0)

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._counts[name] = self._counts.get(name, 0) + amount

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


BACKEND_COUNTERS = (
    "gets",
    "hits",
    "misses",
    *(f"miss_{reason}" for reason in MISS_REASONS),
    "bytes_read",
    "puts",
    "bytes_written",
    "blocks_written",
    "blocks_reused",
    "deletes",
    "evictions",
    "evicted_bytes",
    "put_retries",
    "stale_puts",
    "puts_rewritten",  # a replicated commit gone when read back (a failover), written again
    "puts_unconfirmed",  # on a replicated Redis, kept without a replica's confirmation (none answered)
    "blocks_linked",
    "bytes_saved",
    "cross_agent_hits",
    "shared_collected",
    "expired",
    "discarded",
    # anonymous prefixes (get_prefix / put_prefix)
    "prefix_gets",
    "prefix_hits",
    "prefix_misses",
    "prefix_tokens",
    "prefix_puts",
    "prefix_blocks_written",
    "prefix_blocks_held",
    "prefix_bytes_written",
    "prefix_evictions",
    "prefix_evicted_bytes",
    "prefix_damaged",
)


def record_miss(stats: Stats, name: str, agent_id: str, reason: str, detail: str) -> None:
    """Count a get that returned nothing (`misses`) and why (`miss_<reason>`), and log it."""
    stats.add("misses")
    note_miss(stats, name, agent_id, reason, detail)


def note_miss(stats: Stats, name: str, agent_id: str, reason: str, detail: str) -> None:
    """Count and log why an agent's own cache could not be used: a missing one quietly, anything
    else as a warning. (The get may still return a cache: a cross-agent warm start.)"""
    stats.add(f"miss_{reason}")
    if reason in (ABSENT, NO_COMMON_PREFIX, NAMESPACE_MISMATCH):
        log.debug("%s: cache miss for agent %r: %s (%s)", name, agent_id, reason, detail)
    else:
        log.warning(
            "%s: unusable cache for agent %r treated as a miss: %s (%s)", name, agent_id, reason, detail
        )


def shared_prefix(cache_tokens: np.ndarray, prompt_tokens: Sequence[int] | None) -> int:
    """How many leading tokens of the cache a prompt can reuse (all of them without a prompt)."""
    if prompt_tokens is None:
        return int(cache_tokens.shape[0])
    prompt = np.asarray(prompt_tokens, dtype=np.int64)
    n = min(int(cache_tokens.shape[0]), int(prompt.shape[0]))
    differ = np.flatnonzero(cache_tokens[:n] != prompt[:n])
    return int(differ[0]) if differ.size else n
