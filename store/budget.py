"""Byte budgets: least recently used agents are evicted until the store fits max_bytes, pinned ones never.

Written once for the backends that store caches (BlockStore mixes it in): a backend supplies what it
holds (`_usage`); removing one agent (`_remove`) is BlockStore's delete, a guarded swap of its
manifest to nothing.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from store.backend import BlockBackend
from store.base import log
from store.manifest import parse_shared_name

BUDGET_RESCAN_S = 5.0


@dataclass(frozen=True)
class Usage:
    """One stored agent as budget enforcement sees it."""

    handle: str  # what `_remove` takes (a directory key on disk, the agent id in Redis)
    agent_id: str | None  # None when the manifest is too damaged to name its agent
    nbytes: int  # its own: the manifest and the blocks no other agent can use
    last_used: float
    # (name, bytes) of the shared blocks it uses: counted once however many agents use them,
    # freed with their last user.
    shared: tuple[tuple[str, int], ...] = ()
    pinned: bool = False  # never evicted


def split_shared(blocks: Iterable[tuple[str, int]]) -> tuple[int, tuple[tuple[str, int], ...]]:
    """The bytes of a manifest's own blocks, and the (name, bytes) of the shared ones it uses: a budget
    counts the first per agent (`Usage.nbytes`, with the manifest), the second once for all users."""
    own, shared = 0, []
    for name, nbytes in blocks:
        if parse_shared_name(name) is None:
            own += nbytes
        else:
            shared.append((name, nbytes))
    return own, tuple(shared)


class ByteBudget(BlockBackend):
    """The agents' byte budget of a store (`max_bytes`; None: none)."""

    _estimated_bytes: int = 0
    _last_scan: float = -float("inf")

    @abstractmethod
    def _usage(self) -> list[Usage]:
        """Everything this store holds, one entry per agent (for budget enforcement). A primitive: disk
        reads every manifest (a damaged one counts its directory), Redis its index and size hashes."""

    @abstractmethod
    def _remove(self, handle: str, only_if: bytes | None = None) -> bool:
        """Delete one agent's cache by its usage handle, atomically; False if it was already gone
        (BlockStore's, over the backend's compare-and-swap)."""

    def _after_put(self, handle: str, nbytes: int) -> None:
        """Evict if the store may be over budget (a full scan at most every few seconds otherwise)."""
        if self.max_bytes is None:
            return
        self._estimated_bytes += nbytes
        stale = time.monotonic() - self._last_scan > BUDGET_RESCAN_S
        if stale or self._estimated_bytes > self.max_bytes:
            self.enforce_budget(keep=handle)

    def enforce_budget(self, keep: str | None = None) -> int:
        """Evict least-recently-used agents (never `keep`, never a pinned one) until the store fits
        max_bytes; pinned agents still count, so a store of pinned agents may stay over it."""
        if self.max_bytes is None:
            return 0
        entries = sorted(self._usage(), key=lambda entry: entry.last_used)
        users = Counter(name for entry in entries for name, _ in entry.shared)
        shared_bytes = {name: nbytes for entry in entries for name, nbytes in entry.shared}
        total = sum(entry.nbytes for entry in entries) + sum(shared_bytes.values())
        evicted = 0
        for entry in entries:
            if total <= self.max_bytes:
                break
            if entry.handle == keep or entry.pinned:
                continue
            users.subtract(name for name, _ in entry.shared)
            freed = entry.nbytes + sum(nbytes for name, nbytes in entry.shared if users[name] == 0)
            if self._remove(entry.handle):
                evicted += 1
                self._stats.add("evictions")
                self._stats.add("evicted_bytes", freed)
                log.info(
                    "%s: evicted agent %r (%d bytes, last used %.0f s ago) to stay under %d bytes",
                    self.kind,
                    entry.agent_id,
                    freed,
                    time.time() - entry.last_used,
                    self.max_bytes,
                )
            total -= freed
        self._estimated_bytes = total
        self._last_scan = time.monotonic()
        return evicted
