"""The caches of this worker's recent jobs without an agent, matched token by token.

The store keeps what agent-less jobs leave in full 256-token blocks (any worker reuses them), so a
client that re-sends its whole conversation every turn and names no cache key would prefill up to
255 tokens again each time, and an identical prompt sent twice would too. Here the last few such
caches stay whole in memory (the partial last block included), per namespace, least recently used
out first under a byte budget; a new job takes the longest token prefix any of them shares with its
prompt when that beats what the store can offer.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from engine.core.blocks import AgentCache

#: Entries compared per lookup at most (the most recent ones): a lookup stays well under a step.
MAX_ENTRIES = 64


@dataclass
class _Entry:
    namespace: str
    tokens: np.ndarray  # int64
    cache: AgentCache


class RecentPrefixes:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._bytes = 0
        self._next = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def add(self, cache: AgentCache, namespace: str) -> None:
        """Keep `cache` (a finished job's whole KV); an entry it extends is dropped, being its prefix."""
        if cache.n_tokens == 0 or cache.nbytes > self.max_bytes:
            return
        tokens = np.asarray(cache.token_ids, dtype=np.int64)
        for key, entry in list(self._entries.items()):
            n = entry.tokens.shape[0]
            if (
                entry.namespace == namespace
                and n <= tokens.shape[0]
                and np.array_equal(entry.tokens, tokens[:n])
            ):
                self._drop(key)
        self._entries[self._next] = _Entry(namespace, tokens, cache)
        self._next += 1
        self._bytes += cache.nbytes
        while self._bytes > self.max_bytes or len(self._entries) > MAX_ENTRIES:
            self._drop(next(iter(self._entries)))

    def longest(self, prompt_tokens: list[int], namespace: str) -> AgentCache | None:
        """The kept cache sharing the longest prefix with the prompt, cut to where it can resume."""
        prompt = np.asarray(prompt_tokens, dtype=np.int64)
        best_key, best = None, 0
        for key, entry in reversed(self._entries.items()):
            if entry.namespace != namespace:
                continue
            shared = _shared(entry.tokens, prompt)
            if shared > best:
                best_key, best = key, shared
        if best_key is None:
            return None
        self._entries.move_to_end(best_key)
        cache = self._entries[best_key].cache
        point = cache.resume_point(best)
        return cache.truncated(point) if point > 0 else None

    def _drop(self, key: int) -> None:
        self._bytes -= self._entries.pop(key).cache.nbytes


def _shared(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.shape[0], b.shape[0])
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n
