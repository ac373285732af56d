"""Where a batch run's lines go: rq jobs through the kvrq Producer, behind a small interface.

The driver only needs submit / look up / wait / cancel; keeping that behind `JobSource` lets the unit tests
drive the whole resume and ordering logic with a fake source, and keeps rq details in one place.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from redis import Redis
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus
from rq.results import Result
from rq.serializers import resolve_serializer

from producer.client import Producer, job_failure
from producer.wire.protocol import SERIALIZER, ErrorCode, cancel_key

JobState = Literal["queued", "running", "finished", "failed", "canceled", "missing"]

_STATE_OF_STATUS: dict[str, JobState] = {
    JobStatus.CREATED.value: "queued",
    JobStatus.QUEUED.value: "queued",
    JobStatus.DEFERRED.value: "queued",
    JobStatus.SCHEDULED.value: "queued",
    JobStatus.STARTED.value: "running",
    JobStatus.FINISHED.value: "finished",
    JobStatus.FAILED.value: "failed",
    JobStatus.CANCELED.value: "canceled",
    JobStatus.STOPPED.value: "canceled",
}


@dataclass(frozen=True)
class JobOutcome:
    """A job's state; `result` is set when finished, `error` (one line) and `code` (an ErrorCode value,
    protocol.py) when failed."""

    state: JobState
    result: Mapping[str, Any] | None = None
    error: str | None = None
    code: str | None = None


#: Job ids looked up (or canceled) per call: keeps one pipeline's reply small for runs of any size.
LOOKUP_CHUNK = 1000


def chunks(items: Sequence[str], size: int) -> Iterator[Sequence[str]]:
    """`items` in consecutive slices of at most `size`."""
    for start in range(0, len(items), size):
        yield items[start : start + size]


class JobSource(Protocol):
    """What the batch driver needs from a job queue."""

    def submit(self, jobs: Sequence[tuple[str, Mapping[str, Any]]]) -> None:
        """Enqueue (job_id, request) pairs; an id that already names a job is left as it is."""

    def lookup(self, job_ids: Sequence[str]) -> dict[str, JobOutcome]:
        """Current state of each job (results included for finished ones)."""

    def wait(self, job_ids: Sequence[str], timeout_s: float) -> None:
        """Block until one of the jobs may have ended, or `timeout_s` passed."""

    def cancel(self, job_ids: Sequence[str], *, running: bool = False) -> int:
        """Cancel the jobs still waiting in the queue (and running ones if asked); returns how many."""

    def discard(self, job_ids: Sequence[str]) -> None:
        """Delete ended jobs so their ids can be enqueued afresh (a canceled run that is resumed)."""

    def retire(self, job_ids: Sequence[str], ttl_s: int) -> None:
        """The jobs' lines are in the output: keep them only `ttl_s` more seconds."""


class RqJobSource:
    """JobSource over rq jobs enqueued by the kvrq Producer (JSON serializer, deterministic ids)."""

    def __init__(self, connection: Redis, queue: str, *, tenant: str | None = None) -> None:
        """`tenant`: the run's jobs are that tenant's (producer/tenants.py)."""
        self.connection = connection
        self.producer = Producer(connection=connection, queue=queue, tenant=tenant)
        self._serializer = resolve_serializer(SERIALIZER)
        self._stream_pos: dict[str, bytes | str] = {}

    def submit(self, jobs: Sequence[tuple[str, Mapping[str, Any]]]) -> None:
        if jobs:
            self.producer.submit_many(
                [request for _, request in jobs], job_ids=[job_id for job_id, _ in jobs]
            )

    def lookup(self, job_ids: Sequence[str]) -> dict[str, JobOutcome]:
        pipe = self.connection.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hget(Job.key_for(job_id), "status")
        statuses = pipe.execute()
        outcomes: dict[str, JobOutcome] = {}
        for job_id, raw in zip(job_ids, statuses, strict=True):
            if raw is None:
                outcomes[job_id] = JobOutcome("missing")
                continue
            state = _STATE_OF_STATUS.get(raw.decode() if isinstance(raw, bytes) else str(raw), "queued")
            if state in ("finished", "failed"):
                outcomes[job_id] = self._ended(job_id, state)
            else:
                outcomes[job_id] = JobOutcome(state)
        return outcomes

    def _ended(self, job_id: str, state: JobState) -> JobOutcome:
        if state == "finished":
            latest = Result.fetch_latest(Job(job_id, connection=self.connection), serializer=self._serializer)
            if (
                latest is None
                or latest.type != Result.Type.SUCCESSFUL
                or not isinstance(latest.return_value, dict)
            ):
                return JobOutcome(
                    "failed", error="the job finished, but its result has expired", code=ErrorCode.INTERNAL
                )
            return JobOutcome("finished", result=latest.return_value)
        code, reason, _ = job_failure(self.connection, job_id)
        if self.producer.tenant is not None:
            reason = self.producer.tenant.unqualified(reason)
        return JobOutcome("failed", error=reason, code=code)

    def wait(self, job_ids: Sequence[str], timeout_s: float) -> None:
        """XREAD on the jobs' rq result streams: wakes the moment a worker writes any of their results."""
        if not job_ids:
            return
        streams = {Result.get_key(job_id): self._stream_pos.get(job_id, "0-0") for job_id in job_ids}
        response: Any = self.connection.xread(streams, block=max(1, int(timeout_s * 1000)), count=1)  # type: ignore[arg-type]
        for stream, entries in response or []:
            key = stream.decode() if isinstance(stream, bytes) else str(stream)
            job_id = key.rsplit(":", 1)[-1]
            if entries:
                self._stream_pos[job_id] = entries[-1][0]

    def cancel(self, job_ids: Sequence[str], *, running: bool = False) -> int:
        canceled = 0
        for job_id, outcome in self.lookup(job_ids).items():
            if outcome.state == "queued" or (running and outcome.state == "running"):
                try:
                    if self.producer.handle(job_id).cancel():
                        canceled += 1
                except LookupError:
                    continue  # gone meanwhile
        return canceled

    def retire(self, job_ids: Sequence[str], ttl_s: int) -> None:
        pipe = self.connection.pipeline(transaction=False)
        for job_id in job_ids:
            self._stream_pos.pop(job_id, None)
            pipe.expire(Job.key_for(job_id), ttl_s)
            pipe.expire(Result.get_key(job_id), ttl_s)
        pipe.execute()

    def discard(self, job_ids: Sequence[str]) -> None:
        for job_id in job_ids:
            self._stream_pos.pop(job_id, None)
            # The cancel flag outlives the job: left in place it would cancel the job enqueued afresh.
            self.connection.delete(cancel_key(job_id))
            try:
                Job.fetch(job_id, connection=self.connection, serializer=self._serializer).delete()
            except NoSuchJobError:
                continue
