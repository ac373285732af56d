"""What a worker wrote on a replicated Redis, read back once a replica holds it.

A write the old primary acknowledged just before a failover may be gone on the new one. Job endings
(worker/fleet/confirmed_endings.py) and agent-turn releases (worker/fleet/agent_turns.py) each keep what they
wrote here, and ask about all of it with one `WAIT` and each item's reads (`read_after_wait`): while no
replica confirms, they are asked again every CONFIRM_RETRY_S, for FAILOVER_BUDGET_S. Nothing is kept
on a plain URL. No engine import: the client commands load this module.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from redis import Redis

from producer.wire.redis_url import (
    CONFIRM_RETRY_S,
    CONFIRM_WAIT_MS,
    FAILOVER_BUDGET_S,
    read_after_wait,
    replicas_to_wait,
)

log = logging.getLogger("kvrq.worker")

T = TypeVar("T")


class ReplicaReads(Generic[T]):
    """Items written, each read back once after a replica confirmed every write made before it."""

    def __init__(self, connection: Redis, describe: Callable[[T], str]) -> None:
        self.connection = connection
        self.replicas, timeout_ms = replicas_to_wait(connection)
        self.timeout_ms = min(timeout_ms, CONFIRM_WAIT_MS)
        self.describe = describe  # names an item in the warning when it is given up
        self._pending: list[tuple[T, float]] = []  # (item, monotonic when written)
        self._next_try = 0.0

    def __bool__(self) -> bool:
        return bool(self._pending)

    def add(self, item: T) -> None:
        if self.replicas > 0:
            self._pending.append((item, time.monotonic()))

    def read_back(self, read: Callable[[Any, T], object]) -> list[tuple[T, list[Any]]]:
        """(item, its replies) for every item, once a replica confirmed; `read(pipe, item)` queues the
        item's reads (one or more). [] while none confirms (asked again later). Raises redis-py's
        ConnectionError when Redis is away (the loop's outage handling)."""
        now = time.monotonic()
        if not self._pending or now < self._next_try:
            return []
        asked = list(self._pending)
        counts: list[int] = []  # reads queued per item

        def reads(pipe: Any) -> None:
            for item, _ in asked:
                before = len(pipe)
                read(pipe, item)
                counts.append(len(pipe) - before)

        confirmed, replies = read_after_wait(self.connection, self.replicas, self.timeout_ms, reads)
        if confirmed < self.replicas:
            for item, since in asked:
                if now - since > FAILOVER_BUDGET_S:
                    log.warning("%s was never confirmed on a replica: no longer asked", self.describe(item))
            self._pending = [
                (item, since) for item, since in self._pending if now - since <= FAILOVER_BUDGET_S
            ]
            self._next_try = now + CONFIRM_RETRY_S
            return []
        self._pending = self._pending[len(asked) :]
        found, start = [], 0
        for (item, _), count in zip(asked, counts, strict=True):
            found.append((item, replies[start : start + count]))
            start += count
        return found
