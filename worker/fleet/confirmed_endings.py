"""Job endings confirmed on a replica, so a failover cannot take back a job's result.

On a replicated Redis (a Sentinel URL's `wait`), a write the old primary acknowledged in the instant
before its replica was promoted is gone afterwards. For a job's ending that means: the worker wrote
the result, moved on, and on the new primary the job is still STARTED with nobody running it. Its
client waits until the execution expires (minutes). So after writing endings the loop asks for
`WAIT`, reads back each finished or failed job's status and its stream's last event, and writes
again what a failover dropped. The stream's closing and rq's ending are two transactions, so a
failover can keep one and drop the other: only the half that is gone is written again (a closing
written twice reads as a job run twice; one never written leaves a stream reader waiting). Endings
a replica cannot confirm are kept and asked about again, for FAILOVER_BUDGET_S.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, NamedTuple

from redis import Redis
from rq.job import JobStatus

from producer.wire.protocol import StreamEvent, stream_key
from producer.wire.text import as_text
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


class Lost(NamedTuple):
    """An ending a failover took back, whole or in part: `steps` are the ending steps to write again
    (worker/loop/endings.py): "stream" (its closing event), "rq" and "turn" (rq's ending, the agent's)."""

    held: HeldJob
    outcome: Outcome
    steps: frozenset[str]


def lost_steps(rq_kept: bool, last_event: StreamEvent | None) -> frozenset[str]:
    """What of an ending is gone, from the job's status (as written: `rq_kept`) and its stream's last
    event (None: no stream, which tells nothing: it follows rq)."""
    steps = set() if rq_kept else {"rq", "turn"}
    closed = last_event.final if last_event is not None else rq_kept
    if not closed:
        steps.add("stream")
    return frozenset(steps)


def _last_event(entries: Any) -> StreamEvent | None:
    """The event of an XREVRANGE ... COUNT 1 reply; None for an empty stream, or an event this worker
    cannot read (both tell nothing)."""
    if not entries:
        return None
    try:
        return StreamEvent.from_fields(entries[0][1])
    except ValueError:
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

    def lost(self) -> list[Lost]:
        """The endings a failover dropped, whole or in part (to write again); [] while a replica has not
        confirmed yet. Raises redis-py's ConnectionError when Redis is away (the loop's outage handling)."""
        found = self._written.read_back(_read_ending)
        lost = []
        for item, (raw_status, tail) in found:
            status = as_text(raw_status)
            if status is None:  # deleted meanwhile (result_ttl=0, a client's delete): nothing to redo
                continue
            steps = lost_steps(status == item.status, _last_event(tail))
            if not steps:
                continue
            log.warning(
                "job %s: a failover dropped its ending's %s (it wrote %s; status now %s): writing again",
                item.held.id,
                "+".join(sorted(steps)),
                item.status,
                status,
            )
            lost.append(Lost(item.held, item.outcome, steps))
        return lost


def _read_ending(pipe: Any, item: _Written) -> None:
    """The job's status and its stream's last event."""
    pipe.hget(item.held.job.key, "status")
    pipe.xrevrange(stream_key(item.held.id), count=1)
