"""Job endings confirmed on a replica, so a failover cannot take back a job's result.

On a replicated Redis (a Sentinel URL's `wait`), a write the old primary acknowledged in the instant
before its replica was promoted is gone afterwards. For a job's ending that means: the worker wrote
the result, moved on, and on the new primary the job is still STARTED with nobody running it. Its
client waits until the execution expires (minutes). So after writing endings the loop asks for
`WAIT`, reads back each finished or failed job's status, and writes the endings a failover dropped
again. Endings a replica cannot confirm are kept and asked about again, for FAILOVER_BUDGET_S.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from redis import Redis
from rq.job import JobStatus

from producer.redis_url import (
    CONFIRM_RETRY_S,
    CONFIRM_WAIT_MS,
    FAILOVER_BUDGET_S,
    read_after_wait,
    replicas_to_wait,
)
from worker.held import HeldJob
from worker.outcomes import Failed, Finished, Outcome

log = logging.getLogger("kvrq.worker")


@dataclass
class _Written:
    held: HeldJob
    outcome: Outcome
    status: str  # what the ending wrote
    since: float  # monotonic


def written_status(outcome: Outcome) -> str | None:
    """The job status an ending wrote, where a client waits for it; None: not confirmed (requeues,
    cancels and stops are rq's own business, and a taken-over job's ending is another run's)."""
    if isinstance(outcome, Finished):
        return JobStatus.FINISHED.value
    if isinstance(outcome, Failed) and not outcome.retry:
        return JobStatus.FAILED.value
    return None


class ConfirmedEndings:
    """Endings written on a replicated Redis, until a replica holds them."""

    def __init__(self, connection: Redis) -> None:
        self.connection = connection
        self.replicas, timeout_ms = replicas_to_wait(connection)
        self.timeout_ms = min(timeout_ms, CONFIRM_WAIT_MS)
        self._written: list[_Written] = []
        self._next_try = 0.0

    def written(self, held: HeldJob, outcome: Outcome) -> None:
        status = written_status(outcome)
        if self.replicas > 0 and status is not None:
            self._written.append(_Written(held, outcome, status, time.monotonic()))

    def lost(self) -> list[tuple[HeldJob, Outcome]]:
        """The endings a failover dropped (to write again); [] while a replica has not confirmed yet.
        Raises redis-py's ConnectionError when Redis is away (the loop's outage handling)."""
        now = time.monotonic()
        if not self._written or now < self._next_try:
            return []

        def statuses_of(pipe: Any) -> None:
            for item in self._written:
                pipe.hget(item.held.job.key, "status")

        confirmed, statuses = read_after_wait(self.connection, self.replicas, self.timeout_ms, statuses_of)
        if confirmed < self.replicas:
            expired = [item for item in self._written if now - item.since > FAILOVER_BUDGET_S]
            for item in expired:
                log.warning(
                    "job %s: its ending was never confirmed on a replica: no longer asked", item.held.id
                )
            self._written = [item for item in self._written if item not in expired]
            self._next_try = now + CONFIRM_RETRY_S
            return []
        found = [
            (item, status.decode() if isinstance(status, bytes) else status)
            for item, status in zip(self._written, statuses, strict=True)
        ]
        self._written = []
        # A job deleted meanwhile (result_ttl=0, a client's delete) has no status: nothing to redo.
        lost = [(item, status) for item, status in found if status is not None and status != item.status]
        for item, status in lost:
            log.warning(
                "job %s: its ending (%s) was gone after a failover (status %s): writing it again",
                item.held.id,
                item.status,
                status,
            )
        return [(item.held, item.outcome) for item, _ in lost]
