"""Exponential backoff for reconnecting to Redis."""

from __future__ import annotations

from producer.wire.redis_url import WriteRefusedError

#: The longest wait after a write refused by a server that answered (READONLY, NOREPLICAS): a failover
#: is under way and ends within seconds (~16 s measured); with the doubling alone a worker slept up to
#: 8-16 s past the moment the new primary took writes again.
REFUSED_CAP_S = 1.0


class Backoff:
    def __init__(
        self, initial: float = 0.5, factor: float = 2.0, cap: float = 30.0, refused_cap: float = REFUSED_CAP_S
    ) -> None:
        self.initial = initial
        self.factor = factor
        self.cap = cap
        self.refused_cap = refused_cap
        self._next = initial
        self.failures = 0

    def next(self, error: BaseException | None = None) -> float:
        """Seconds to wait before the next try; grows until `cap` (`refused_cap` after a refused write)."""
        delay = self._next
        self._next = min(self._next * self.factor, self.cap)
        self.failures += 1
        if isinstance(error, WriteRefusedError):
            return min(delay, self.refused_cap)
        return delay

    def reset(self) -> None:
        self._next = self.initial
        self.failures = 0
