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
from dataclasses import dataclass

from redis import Redis
from rq.job import JobStatus

from worker.fleet.replica_reads import ReplicaReads
from worker.loop.held import HeldJob
from worker.loop.outcomes import Failed, Finished, Outcome

log = logging.getLogger("kvrq.worker")


@dataclass
class _Written:
    held: HeldJob
    outcome: Outcome
    status: str  # what the ending wrote


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
        self._written: ReplicaReads[_Written] = ReplicaReads(
            connection, lambda item: f"job {item.held.id}'s ending"
        )

    def written(self, held: HeldJob, outcome: Outcome) -> None:
        status = written_status(outcome)
        if status is not None:
            self._written.add(_Written(held, outcome, status))

    def lost(self) -> list[tuple[HeldJob, Outcome]]:
        """The endings a failover dropped (to write again); [] while a replica has not confirmed yet.
        Raises redis-py's ConnectionError when Redis is away (the loop's outage handling)."""
        found = self._written.read_back(lambda pipe, item: pipe.hget(item.held.job.key, "status"))
        statuses = [(item, raw.decode() if isinstance(raw, bytes) else raw) for item, raw in found]
        # A job deleted meanwhile (result_ttl=0, a client's delete) has no status: nothing to redo.
        lost = [(item, status) for item, status in statuses if status is not None and status != item.status]
        for item, status in lost:
            log.warning(
                "job %s: its ending (%s) was gone after a failover (status %s): writing it again",
                item.held.id,
                item.status,
                status,
            )
        return [(item.held, item.outcome) for item, _ in lost]
