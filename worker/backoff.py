"""Exponential backoff for reconnecting to Redis."""

from __future__ import annotations


class Backoff:
    def __init__(self, initial: float = 0.5, factor: float = 2.0, cap: float = 30.0) -> None:
        self.initial = initial
        self.factor = factor
        self.cap = cap
        self._next = initial
        self.failures = 0

    def next(self) -> float:
        """Seconds to wait before the next try; grows until `cap`."""
        delay = self._next
        self._next = min(self._next * self.factor, self.cap)
        self.failures += 1
        return delay

    def reset(self) -> None:
        self._next = self.initial
        self.failures = 0
