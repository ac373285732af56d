"""rq bookkeeping for a worker that holds many jobs at once: one rq execution per held job.

rq's own workers run one job at a time in a forked horse; this worker runs them all in one
engine loop, so it drives rq's execution API itself. Everything that touches rq internals
is in this module; the one private call (`_finalize_success`) is in `finish_job`, and
pyproject pins rq to 3.0.x for it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from queue import SimpleQueue
from typing import Any

from redis import Redis
from rq.command import parse_payload
from rq.exceptions import InvalidJobOperation
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.utils import now
from rq.worker import BaseWorker, WorkerStatus

from producer.protocol import SERIALIZER, cancel_key

log = logging.getLogger("kvrq.worker")


def default_worker_name() -> str:
    return f"kvrq.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:4]}"


class KvrqWorker(BaseWorker):
    """The rq worker record (`rq info`, dashboards, heartbeats, commands) of a kvrq worker process.

    `work()` is never called: the engine loop dequeues and finishes jobs through the
    functions below. Stop commands (`rq` CLI, dashboards, `JobHandle.cancel`) arrive on
    the pubsub thread and are handed to the loop through `commands`.
    """

    def __init__(
        self,
        queues: list[str],
        *,
        connection: Redis,
        name: str | None = None,
        heartbeat_ttl: int = 90,
        default_result_ttl: int = 3600,
        prepare_for_work: bool = True,
    ) -> None:
        super().__init__(
            queues,
            name=name or default_worker_name(),
            connection=connection,
            serializer=SERIALIZER,
            default_result_ttl=default_result_ttl,
            worker_ttl=max(heartbeat_ttl, 30),
            prepare_for_work=prepare_for_work,
        )
        self.heartbeat_ttl = heartbeat_ttl
        self.commands: SimpleQueue[dict[str, Any]] = SimpleQueue()

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        return self.heartbeat_ttl

    def handle_payload(self, message: dict[Any, Any]) -> None:
        payload = parse_payload(message)
        if payload.get("command") in ("stop-job", "stop-execution"):
            self.commands.put(payload)
        else:
            super().handle_payload(message)  # shutdown sends us SIGINT: the loop drains

    def execute_job(self, job: Job, queue: Queue) -> None:
        raise NotImplementedError("kvrq workers run jobs in their engine loop")


def start_job(worker: KvrqWorker, job: Job, queue: Queue) -> Execution:
    """Mark the job started (StartedJobRegistry, execution, heartbeat), off the intermediate queue."""
    execution = worker.prepare_execution(job)
    worker.prepare_job_execution(job, remove_from_intermediate_queue=True)
    return execution


def finish_job(
    worker: KvrqWorker, job: Job, queue: Queue, execution: Execution, result: dict[str, Any]
) -> None:
    """Finish the job with `result` as its rq return value (FinishedJobRegistry, Result stream).

    rq has no public call for "this execution returned this value" outside its own
    fork loop; `_finalize_success` is that call (stable across rq 2.x-3.0).
    """
    worker._finalize_success(job, queue, execution, result)


def fail_job(
    worker: KvrqWorker, job: Job, queue: Queue, execution: Execution | None, reason: str, *, retry: bool
) -> None:
    """Fail the job with `reason` (rq's exc_string); with `retry` rq re-queues it while retries are left."""
    if not retry:
        job.retries_left = 0  # a bad request stays bad: never retried
    job.ended_at = now()
    if job.started_at is None:
        job.started_at = job.ended_at
    worker.handle_job_failure(job, queue, exc_string=reason, execution=execution)


def reject_job(worker: KvrqWorker, job: Job, queue: Queue, reason: str) -> None:
    """Fail a dequeued job that can never run, before it is started (bad payload)."""
    execution = worker.prepare_execution(job)
    fail_job(worker, job, queue, execution, reason, retry=False)
    queue.intermediate_queue.remove(job.id)


def cancel_job(worker: KvrqWorker, job: Job, queue: Queue, execution: Execution) -> None:
    """End a held job as CANCELED (CanceledJobRegistry), as rq's `job.cancel()` does for queued ones."""
    with worker.connection.pipeline() as pipe:
        worker.cleanup_execution(job, pipeline=pipe, execution=execution)
        pipe.delete(cancel_key(job.id))
        pipe.execute()
    with contextlib.suppress(InvalidJobOperation):  # the producer canceled it already
        job.cancel()


def requeue_job(worker: KvrqWorker, job: Job, queue: Queue, execution: Execution, *, at_front: bool) -> None:
    """Put a held job back on its queue (drain): it runs again from the start, on any worker."""
    with worker.connection.pipeline() as pipe:
        job.started_at = None
        job.ended_at = None
        job.worker_name = None
        queue.enqueue_job(job, pipeline=pipe, at_front=at_front)  # first: it opens the MULTI
        worker.cleanup_execution(job, pipeline=pipe, execution=execution)
        pipe.execute()


def drop_execution(worker: KvrqWorker, job: Job, execution: Execution) -> None:
    """Forget a job someone else has taken over (requeued by cleanup, deleted): touch nothing else."""
    with worker.connection.pipeline() as pipe:
        worker.cleanup_execution(job, pipeline=pipe, execution=execution)
        pipe.execute()


@dataclass(frozen=True)
class JobSignals:
    """What the heartbeat learned about one held job."""

    status: str | None  # None: the job hash is gone
    cancel_requested: bool

    @property
    def still_ours(self) -> bool:
        return self.status == JobStatus.STARTED


def heartbeat(
    worker: KvrqWorker, held: Iterable[tuple[Job, Execution]], fields: dict[str, str | int] | None = None
) -> dict[str, JobSignals]:
    """One round trip: worker heartbeat (plus `fields` in its hash), every held execution's heartbeat,
    and each held job's status and cancel flag."""
    held = list(held)
    ttl = worker.heartbeat_ttl
    with worker.connection.pipeline() as pipe:
        worker.heartbeat(pipeline=pipe)
        if fields:
            pipe.hset(worker.key, mapping=fields)  # type: ignore[arg-type]
        for job, execution in held:
            execution.heartbeat(job.started_job_registry, ttl, pipeline=pipe)
        marks = len(pipe)
        for job, _ in held:
            pipe.hget(job.key, "status")
            pipe.exists(cancel_key(job.id))
        replies = pipe.execute()[marks:]
    signals = {}
    for index, (job, _) in enumerate(held):
        raw_status, flag = replies[2 * index], replies[2 * index + 1]
        status = raw_status.decode() if isinstance(raw_status, bytes) else raw_status
        signals[job.id] = JobSignals(status=status, cancel_requested=bool(flag))
    return signals


def set_busy(worker: KvrqWorker, busy: bool) -> None:
    state = WorkerStatus.BUSY if busy else WorkerStatus.IDLE
    if worker.get_state() != state:
        worker.set_state(state)
