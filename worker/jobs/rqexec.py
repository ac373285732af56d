"""rq bookkeeping for a worker that holds many jobs at once: one rq execution per held job.

rq's own workers run one job at a time in a forked horse; this worker runs them all in one
engine loop, so it drives rq's execution API itself. Every use of rq internals in kvrq is
in this module (private: `job._result` / `job._status` in `finish_job` and `fail_job`, as
rq's `_finalize_success` / `_finalize_failure` set them; rq's `_stopped_job_id` marker in
`stop_job`; the pubsub thread's `_pubsub_exception_handler` override; the registry and
execution layouts through rq's own classes; callbacks through rq's own `execute_*_callback`);
pyproject pins rq to 3.0.x and tests/worker/test_rqexec.py fails loudly when the pinned rq changes them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from queue import SimpleQueue
from typing import Any, Literal

from redis import Redis
from redis.client import PubSub, PubSubWorkerThread
from redis.exceptions import ConnectionError as RedisConnectionError
from rq.callbacks import execute_failure_callback, execute_stopped_callback, execute_success_callback
from rq.command import parse_payload
from rq.exceptions import AbandonedJobError, DequeueTimeout, InvalidJobOperation, NoSuchJobError
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.job_lifecycle import record_job_failure
from rq.queue import Queue
from rq.serializers import resolve_serializer
from rq.timeouts import BaseDeathPenalty, JobTimeoutException, TimerDeathPenalty, UnixSignalDeathPenalty
from rq.utils import get_version, now
from rq.worker import BaseWorker, WorkerStatus
from rq.worker_registration import REDIS_WORKER_KEYS, WORKERS_BY_QUEUE_KEY

from producer.wire.protocol import (
    CRASH_BUDGET_META_KEY,
    CRASHES_META_KEY,
    ERROR_META_KEY,
    SERIALIZER,
    ErrorCode,
    cancel_key,
    shared_queue_of,
    worker_queue_name,
)
from producer.wire.text import as_text
from worker.jobs.bounded_job import BoundedJob

log = logging.getLogger("kvrq.worker")
COMMAND_LISTENER_RETRY_S = 2.0  # rq's own pause before its pubsub thread reconnects


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
        affinity: bool = False,
    ) -> None:
        """`affinity`: serve this worker's own queue of each shared queue first (agents it holds hot)."""
        name = name or default_worker_name()
        if affinity:
            queues = [q for shared in queues for q in (worker_queue_name(shared, name), shared)]
        super().__init__(
            queues,
            name=name,
            connection=connection,
            serializer=SERIALIZER,
            job_class=BoundedJob,  # job data over MAX_JOB_DATA_BYTES is never decompressed
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

    def _pubsub_exception_handler(
        self, exc: Exception, pubsub: PubSub, pubsub_thread: PubSubWorkerThread
    ) -> None:
        """The command listener waits out a lost Redis connection without rq's ERROR line.

        Why: the engine loop already reports an outage (a warning, with backoff), and rq's handler
        logged an ERROR every 2 s of it, and one at every stop of a whole stack (honcho stops Redis
        beside the worker) after a clean drain. The retry is rq's: redis-py re-subscribes on reconnect.
        """
        if not isinstance(exc, RedisConnectionError):
            super()._pubsub_exception_handler(exc, pubsub, pubsub_thread)
            return
        log.debug(
            "command listener: Redis unreachable (%s): retrying in %.0f s", exc, COMMAND_LISTENER_RETRY_S
        )
        time.sleep(COMMAND_LISTENER_RETRY_S)


def dequeue(worker: KvrqWorker, queues: list[Queue], timeout: int | None) -> tuple[Job, Queue] | None:
    """The first job of `queues` (in order), or None; `timeout`: seconds to block while all are empty.

    Without a timeout each queue is tried with LMOVE into rq's intermediate queue, where rq's own
    `dequeue_any` uses LPOP as soon as a worker listens on several queues (a kvrq worker always
    does: its own queue and the shared one). A job popped by LPOP whose start then fails (Redis
    going away between the two: a failover's CLIENT KILL) is in no list at all, QUEUED with
    nobody to run it; one moved by LMOVE stays in the intermediate queue, and maintenance puts it
    back on its queue after a minute. The blocking wait (an idle worker) is still rq's BLPOP."""
    if timeout is None and len(queues) > 1 and get_version(worker.connection) >= (6, 2, 0):
        for queue in queues:
            while (moved := Queue.lmove(worker.connection, queue.key, None)) is not None:
                job_id = as_text(moved[1])
                try:
                    return worker.job_class.fetch(
                        job_id, connection=worker.connection, serializer=worker.serializer
                    ), queue
                except NoSuchJobError:
                    queue.intermediate_queue.remove(job_id)  # deleted while queued, as rq skips it
        return None
    try:
        return Queue.dequeue_any(
            queues,
            timeout,
            connection=worker.connection,
            job_class=worker.job_class,
            serializer=worker.serializer,
        )
    except DequeueTimeout:
        return None


def start_job(worker: KvrqWorker, job: Job, queue: Queue) -> Execution:
    """Mark the job started (StartedJobRegistry, execution, heartbeat), off the intermediate queue."""
    execution = worker.prepare_execution(job)
    worker.prepare_job_execution(job, remove_from_intermediate_queue=True)
    return execution


def finish_job(
    worker: KvrqWorker, job: Job, queue: Queue, execution: Execution, result: dict[str, Any]
) -> bool:
    """Finish the job with `result` as its rq return value (FinishedJobRegistry, Result stream,
    dependents enqueued), after its `on_success` callback, as rq's `_finalize_success` does.

    False, and nothing written, when the execution is no longer ours (re-run elsewhere after
    this worker was taken for dead): a job gets one result, never two. Unlike rq, a success
    callback that raises is logged and fails nothing: the answer is good.
    """
    if not owns_execution(worker.connection, job, execution):
        return False
    worker.handle_execution_ended(job, queue, job.success_callback_timeout)
    job._result = result
    job._status = JobStatus.FINISHED
    run_callback(job, "success", result)
    worker.handle_job_success(
        job=job, queue=queue, started_job_registry=queue.started_job_registry, execution=execution
    )
    job.send_webhooks(JobStatus.FINISHED)
    return True


class JobError(Exception):
    """What a kvrq job's `on_failure` callback receives for a failure that raised nothing
    (rq passes the job's exception): `code` is producer.wire.protocol.ErrorCode."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


CallbackKind = Literal["success", "failure", "stopped"]
_CALLBACK_RUNNERS: dict[str, Callable[..., None]] = {
    "success": execute_success_callback,
    "failure": execute_failure_callback,
    "stopped": execute_stopped_callback,
}


def run_callback(job: Job, kind: CallbackKind, *args: Any) -> None:
    """Run the job's `on_<kind>` callback as rq does (its arguments, its timeout: rq's
    `execute_*_callback`); one that raises or times out is logged and changes nothing else."""
    try:
        _CALLBACK_RUNNERS[kind](job, death_penalty(), *args)
    except Exception:
        log.exception("job %s: its on_%s callback failed (logged; the job's outcome stands)", job.id, kind)


def death_penalty() -> type[BaseDeathPenalty]:
    """rq's timeout for callbacks: SIGALRM on the main thread (the loop), a timer elsewhere."""
    if threading.current_thread() is threading.main_thread():
        return UnixSignalDeathPenalty
    return TimerDeathPenalty


def failure_exc_info(code: str, message: str) -> tuple[type[BaseException], BaseException, None]:
    """The (type, value, traceback) an `on_failure` callback gets: rq's own exception where one fits."""
    error: BaseException
    if code == ErrorCode.TIMEOUT:
        error = JobTimeoutException(message)
    elif code == ErrorCode.WORKER_CRASHED:
        error = AbandonedJobError(message)
    else:
        error = JobError(code, message)
    return type(error), error, None


def owns_execution(connection: Redis, job: Job, execution: Execution) -> bool:
    """Whether `execution` is still the job's live run (in the StartedJobRegistry, job STARTED)."""
    with connection.pipeline(transaction=False) as pipe:
        pipe.zscore(job.started_job_registry.key, execution.composite_key)
        pipe.hget(job.key, "status")
        score, status = pipe.execute()
    return score is not None and as_text(status) == JobStatus.STARTED


def fail_job(
    worker: KvrqWorker,
    job: Job,
    queue: Queue,
    execution: Execution | None,
    reason: str,
    *,
    retry: bool,
    code: str = ErrorCode.INTERNAL,
    message: str | None = None,
) -> None:
    """Fail the job with `reason` (rq's exc_string) after its `on_failure` callback, as rq does; with
    `retry` rq re-queues it while retries are left (`Retry(interval=...)`: scheduled on the shared queue,
    so any worker's scheduler moves it back), otherwise its dependents are enqueued as rq decides.

    The structured error (job.meta[ERROR_META_KEY]) is written by the caller before this.
    """
    if not retry:
        job.retries_left = 0  # a bad request stays bad: never retried
    job.ended_at = now()
    if job.started_at is None:
        job.started_at = job.ended_at
    job._status = JobStatus.FAILED  # what the callback sees, as in rq's _finalize_failure
    run_callback(job, "failure", *failure_exc_info(code, message or reason))
    worker.handle_job_failure(job, _shared(queue), exc_string=reason, execution=execution)


def stop_job(worker: KvrqWorker, job: Job, queue: Queue, execution: Execution) -> None:
    """End a held job as rq ends one stopped by `send_stop_job_command`: its `on_stopped` callback,
    then STOPPED in the FailedJobRegistry, never retried (its dependents stay deferred, as in rq)."""
    job.ended_at = now()
    if job.started_at is None:
        job.started_at = job.ended_at
    run_callback(job, "stopped")
    worker._stopped_job_id = job.id  # rq's marker: handle_job_failure records STOPPED, no retry
    worker.handle_job_failure(
        job, queue, exc_string="Job stopped by user (stop-job command)", execution=execution
    )


def _shared(queue: Queue) -> Queue:
    """The shared queue of a worker's own queue (a retry may run on any worker)."""
    name = shared_queue_of(queue.name)
    if name == queue.name:
        return queue
    return Queue(name, connection=queue.connection, serializer=SERIALIZER, job_class=queue.job_class)


def start_rejected(worker: KvrqWorker, job: Job, queue: Queue) -> Execution:
    """An execution for a dequeued job that will only be failed (its payload may not even decode)."""
    execution = worker.prepare_execution(job)
    queue.intermediate_queue.remove(job.id)
    return execution


def forget_dequeued(job: Job, queue: Queue) -> None:
    """Let go of a dequeued job that needs nothing more (canceled while queued)."""
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
    registered: bool  # our execution is still in the StartedJobRegistry

    @property
    def still_ours(self) -> bool:
        return self.status == JobStatus.STARTED and self.registered


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
        for job, execution in held:
            pipe.hget(job.key, "status")
            pipe.exists(cancel_key(job.id))
            pipe.zscore(job.started_job_registry.key, execution.composite_key)
        replies = pipe.execute()[marks:]
    signals = {}
    for index, (job, _) in enumerate(held):
        raw_status, flag, score = replies[3 * index : 3 * index + 3]
        signals[job.id] = JobSignals(
            status=as_text(raw_status), cancel_requested=bool(flag), registered=score is not None
        )
    return signals


def register_again(worker: KvrqWorker) -> bool:
    """Put the worker back in rq's registry if another worker took it for dead and removed it (True)."""
    if worker.connection.sismember(REDIS_WORKER_KEYS, worker.key):
        return False
    worker.connection.delete(worker.key)  # a partial hash left by heartbeats since
    worker.register_birth()
    return True


def set_busy(worker: KvrqWorker, busy: bool) -> None:
    state = WorkerStatus.BUSY if busy else WorkerStatus.IDLE
    if worker.get_state() != state:
        worker.set_state(state)


# ---- crash re-runs (a dead worker's executions, found by worker/fleet/maintenance.py) --------------


def started_executions(queue: Queue) -> list[Execution]:
    """Every execution in the queue's StartedJobRegistry (no cleanup: that would fail them as abandoned)."""
    executions = []
    for job_id, execution_id in queue.started_job_registry.get_job_and_execution_ids(cleanup=False):
        execution = Execution(id=execution_id, job_id=job_id, connection=queue.connection)
        # ValueError: its hash expired (no worker name, still an orphan). KeyError: a partial hash, a live
        # worker's heartbeat on an execution another worker had just re-run (after a failover's write
        # pause outlasted the liveness TTL): before, every worker's crash check raised on it and exited.
        with contextlib.suppress(ValueError, KeyError):
            execution.refresh()
        executions.append(execution)
    return executions


def heartbeat_expired(queue: Queue, execution: Execution, at: float) -> bool:
    score = queue.connection.zscore(queue.started_job_registry.key, execution.composite_key)
    return score is not None and float(score) < at


def rerun_after_crash(queue: Queue, execution: Execution, *, default_budget: int, why: str) -> str:
    """Re-queue (at the front) or fail the job of a dead worker's execution; returns what happened.

    Each crash re-run spends the job's own crash budget (job.meta[CRASH_BUDGET_META_KEY], else
    `default_budget`), separate from rq's `retries`. A job past it (poison: it keeps killing its
    workers) fails with ErrorCode.WORKER_CRASHED instead of taking the fleet down in a loop.
    """
    connection = queue.connection
    try:
        job = Job.fetch(execution.job_id, connection=connection, serializer=SERIALIZER)
    except Exception:  # gone or unreadable: only the registry entry is left to remove
        connection.zrem(queue.started_job_registry.key, execution.composite_key)
        return "gone"
    if job.get_status(refresh=False) != JobStatus.STARTED:
        with connection.pipeline() as pipe:
            execution.delete(job, pipeline=pipe)
            pipe.execute()
        return "not-started"
    crashes = int(job.meta.get(CRASHES_META_KEY, 0)) + 1
    budget = job.meta.get(CRASH_BUDGET_META_KEY, default_budget)
    budget = budget if isinstance(budget, int) and not isinstance(budget, bool) and budget >= 0 else 2
    job.meta[CRASHES_META_KEY] = crashes
    serializer = resolve_serializer(SERIALIZER)
    with connection.pipeline() as pipe:
        if crashes <= budget:
            job.started_at = None
            job.ended_at = None
            job.worker_name = None
            shared = Queue(shared_queue_of(queue.name), connection=connection, serializer=SERIALIZER)
            shared.enqueue_job(job, pipeline=pipe, at_front=True)  # first: it opens the MULTI
            execution.delete(job, pipeline=pipe)
            outcome = "requeued"
        else:
            message = (
                f"its worker died {crashes} times while running it ({why}); crash budget of {budget} "
                "re-runs spent: failing it so it cannot take more workers down"
            )
            run_callback(job, "failure", *failure_exc_info(ErrorCode.WORKER_CRASHED, message))
            job.meta[ERROR_META_KEY] = {"code": ErrorCode.WORKER_CRASHED, "message": message}
            pipe.multi()
            execution.delete(job, pipeline=pipe)
            job.ended_at = now()
            record_job_failure(job, f"WorkerCrashedError: {message}", pipe)
            outcome = "failed"
        pipe.hset(job.key, "meta", serializer.dumps(job.meta))
        pipe.execute()
    if outcome == "failed":  # as rq's abandoned-job cleanup: dependents that allow a failure run now
        queue.enqueue_dependents(job)
    return outcome


def forget_worker(connection: Redis, worker_name: str, queue_names: list[str]) -> None:
    """Remove a dead worker's rq record, so `rq info` and dashboards stop listing it."""
    key = worker_key(worker_name)
    with connection.pipeline() as pipe:
        pipe.delete(key)
        pipe.srem(REDIS_WORKER_KEYS, key)
        for name in queue_names:
            pipe.srem(WORKERS_BY_QUEUE_KEY % name, key)
        pipe.execute()


def workers_key(queue_name: str | None = None) -> str:
    """rq's set of registered workers (of one queue, or all)."""
    return REDIS_WORKER_KEYS if queue_name is None else WORKERS_BY_QUEUE_KEY % queue_name


def worker_key(worker_name: str) -> str:
    return f"{BaseWorker.redis_worker_namespace_prefix}{worker_name}"


def is_kvrq_worker(connection: Redis, worker_name: str, marker_field: str) -> bool | None:
    """True/False from the worker's rq hash; None when the hash is gone."""
    key = worker_key(worker_name)
    if not connection.exists(key):
        return None
    return connection.hexists(key, marker_field)


def worker_queues_of(connection: Redis, shared_queue: str) -> list[str]:
    """Every worker's own queue of `shared_queue` that rq knows (live workers' and dead ones')."""
    prefix = Queue.redis_queue_namespace_prefix + worker_queue_name(shared_queue, "")
    keys = [as_text(key) or "" for key in connection.smembers(Queue.redis_queues_keys)]
    return sorted(
        key.removeprefix(Queue.redis_queue_namespace_prefix) for key in keys if key.startswith(prefix)
    )


def waited_longer(queue: Queue, seconds: float) -> bool:
    """Whether the job at the head of `queue` was enqueued more than `seconds` ago."""
    head = queue.connection.lindex(queue.key, 0)
    if head is None:
        return False
    enqueued = queue.connection.hget(Job.key_for(as_text(head) or ""), "enqueued_at")
    if enqueued is None:
        return True  # a dangling id: let dequeue clean it up
    stamp = datetime.fromisoformat((as_text(enqueued) or "").replace("Z", "+00:00"))
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=timezone.utc)
    return (datetime.now(timezone.utc) - stamp).total_seconds() > seconds
