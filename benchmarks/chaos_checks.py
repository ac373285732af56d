"""What a chaos run checks about each job once the dust settles: delivered exactly once.

A job is *lost* when it never ends, *failed* when it ends without a result, *duplicated* when
rq holds more than one result for it or its stream closes more than once. Its stream tells how
many times it ran (one `start` event per attempt that got as far as streaming; a worker killed
between taking a job and its first flush leaves none), its job.meta how many times it was
re-queued after its worker died; the text a reader streams must be the result's text. Shared by
the integration tests and benchmarks/chaos.py.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from redis import Redis
from rq.job import Job
from rq.results import Result
from rq.serializers import JSONSerializer

from producer.client import JobFailedError, JobHandle
from producer.wire.protocol import CRASHES_META_KEY, StreamEvent, stream_key

ENDED = ("finished", "failed", "canceled", "stopped")


def stream_events(connection: Redis, job_id: str) -> list[StreamEvent]:
    """Every event of the job's stream, read once (no waiting)."""
    entries: Any = connection.xrange(stream_key(job_id))
    return [StreamEvent.from_fields(fields) for _, fields in entries]


def attempts(connection: Redis, job_id: str) -> int:
    """How many times a worker started the job: its stream's start events."""
    return sum(event.kind == "start" for event in stream_events(connection, job_id))


def crash_reruns(connection: Redis, job_id: str) -> int:
    """How many times the job was re-queued because its worker died (job.meta, kvrq's count)."""
    meta = Job.fetch(job_id, connection=connection, serializer=JSONSerializer).get_meta(refresh=False)
    value = meta.get(CRASHES_META_KEY, 0)
    return value if isinstance(value, int) else 0


def results_of(connection: Redis, job_id: str) -> list[Result]:
    """Every rq Result kept for the job (rq keeps one per run that reported)."""
    return Job(job_id, connection=connection, serializer=JSONSerializer).results()


@dataclass(frozen=True)
class Delivery:
    job_id: str
    status: str
    attempts: int  # start events
    closings: int  # end + error events
    results: int  # rq Result entries
    crashes: int = 0  # re-queued after its worker died
    code: str | None = None  # ErrorCode of a failed job
    streamed_matches: bool | None = None  # stream() text == result text (finished jobs)

    @property
    def lost(self) -> bool:
        return self.status not in ENDED

    @property
    def duplicated(self) -> bool:
        return self.results > 1 or self.closings > 1

    @property
    def finished_once(self) -> bool:
        return (
            self.status == "finished"
            and self.results == 1
            and self.closings == 1
            and self.streamed_matches is True
        )


def delivery(handle: JobHandle) -> Delivery:
    connection = handle.connection
    status = handle.status()
    events = stream_events(connection, handle.id)
    starts = sum(e.kind == "start" for e in events)
    closings = sum(e.final for e in events)
    results = len(results_of(connection, handle.id))
    crashes = crash_reruns(connection, handle.id)
    if status == "finished":
        text = handle.result(timeout=5).text
        streamed = "".join(handle.stream(timeout=5))
        return Delivery(
            handle.id, status, starts, closings, results, crashes, streamed_matches=streamed == text
        )
    code = None
    if status == "failed":
        try:
            handle.result(timeout=1)
        except JobFailedError as exc:
            code = exc.code
    return Delivery(handle.id, status, starts, closings, results, crashes, code=code)


def deliveries(handles: Iterable[JobHandle]) -> list[Delivery]:
    return [delivery(handle) for handle in handles]


def summary(items: list[Delivery]) -> dict[str, int]:
    """finished / failed / lost / duplicated counts; jobs re-queued after a crash; jobs streamed twice."""
    return {
        "finished": sum(d.status == "finished" for d in items),
        "failed": sum(d.status == "failed" for d in items),
        "lost": sum(d.lost for d in items),
        "duplicated": sum(d.duplicated for d in items),
        "crash_rerun": sum(d.crashes > 0 for d in items),
        "streamed_twice": sum(d.attempts > 1 for d in items),
    }
