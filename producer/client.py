"""Producer: enqueue generation jobs as plain rq jobs and follow them (result, status, stream, cancel).

Only redis, rq and pydantic are needed here: a web app that enqueues jobs never imports MLX.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any, TypeVar

from redis import Redis
from redis.exceptions import WatchError
from rq import Queue
from rq.command import send_stop_job_command
from rq.exceptions import InvalidJobOperation, NoSuchJobError
from rq.job import Job, JobStatus
from rq.results import Result
from rq.serializers import resolve_serializer

from producer import liveness, outcome, waits
from producer.conversation import read_conversation
from producer.enqueue import DEFAULT_JOB_TIMEOUT, JobWriter, placing, validated
from producer.errors import JobCanceledError, JobFailedError, JobNotFoundError, ResultTimeoutError
from producer.liveness import job_wait_detail, no_worker_line, unheard_queue
from producer.models import GenerationRequest, GenerationResult
from producer.outcome import TERMINAL_STATUSES, Replay
from producer.tenants import Tenant, tenant_of
from producer.wire.protocol import (
    CANCEL_FLAG_TTL_S,
    DEFAULT_QUEUE,
    SERIALIZER,
    StreamEvent,
    cancel_key,
)
from producer.wire.redis_url import REDIS_DOWN, UNSENT, connect, retry_unsent, wait_replicated

__all__ = [
    "DEFAULT_JOB_TIMEOUT",
    "TERMINAL_STATUSES",
    "JobCanceledError",
    "JobFailedError",
    "JobHandle",
    "JobNotFoundError",
    "Producer",
    "ResultTimeoutError",
    "job_failure",
]

logger = logging.getLogger("kvrq.producer")

T = TypeVar("T")
OnWait = Callable[[], object]


def job_failure(connection: Redis, job_id: str) -> tuple[str, str, str | None]:
    """(code, one-line reason, rq's exc_string) of a failed job: the worker's structured error in
    job.meta when it wrote one, else what rq recorded (protocol.failure_of)."""
    latest = outcome.latest_result(job_id, connection.xrevrange(Result.get_key(job_id), "+", "-", count=1))
    return outcome.failure_parts(latest, connection.hget(Job.key_for(job_id), "meta"))


class JobHandle:
    """A submitted job. Cheap to create: it holds an id, and reads Redis when asked.

    A tenant's handle (`tenant`) shows the job as that tenant's client sees it: its result's agent id
    and its failure's reason with the tenant's qualified agent ids unqualified (producer/tenants.py).
    """

    def __init__(self, connection: Redis, job_id: str, *, tenant: Tenant | None = None) -> None:
        self.connection = connection
        self.id = job_id
        self.tenant = tenant
        self._serializer = resolve_serializer(SERIALIZER)

    def __repr__(self) -> str:
        return f"JobHandle({self.id!r})"

    def job(self) -> Job:
        try:
            return Job.fetch(self.id, connection=self.connection, serializer=self._serializer)
        except NoSuchJobError:
            raise JobNotFoundError(f"no job {self.id} in Redis") from None

    def status(self) -> str:
        """rq's status string: queued, started, finished, failed, canceled, ..."""
        return self._run(waits.status(self.id))

    def meta(self) -> dict[str, Any]:
        """rq's job.meta; the worker keeps `progress` (phase, tokens so far) there."""
        return dict(self.job().get_meta())

    def result(self, timeout: float | None = None, *, on_wait: OnWait | None = None) -> GenerationResult:
        """Wait for the job to end; return its result or raise JobFailedError / JobCanceledError.

        Raises ResultTimeoutError when `timeout` seconds pass first (the job goes on); its message
        says where the job stands (e.g. queued where no live worker listens). `on_wait` is called
        about every second of waiting; by default a warning is logged, once, when the job still
        waits after a few seconds in a queue no live worker listens on.
        """
        return self._run(waits.result(self.id, timeout), on_wait or _UnheardJobWarning(self))

    def _outcome(self) -> GenerationResult | None:
        """The result once the job has ended (None before); raises its failure (outcome.outcome)."""
        return self._run(waits.ended(self.id, self.tenant))

    def _run(self, wait: waits.Wait[T], on_wait: OnWait = waits.quiet) -> T:
        """A wait without events (waits.py holds its rule), run to its value."""
        run = waits.Run(wait)
        for _ in self._drive(run, on_wait):
            pass
        return run.value

    def _drive(self, run: waits.Run[Any], on_wait: OnWait) -> Iterator[StreamEvent]:
        """Answers a wait's steps with this client's blocking I/O, passing its events on."""
        while (step := run.step) is not None:
            if isinstance(step, waits.Emit):
                yield step.event
            run.settle(lambda: self._answer(step, on_wait))

    def _answer(self, step: waits.Step, on_wait: OnWait) -> Any:
        if isinstance(step, waits.Read):
            return retry_unsent(lambda: self._send(step), errors=REDIS_DOWN)
        if isinstance(step, waits.Outcome):
            return self._outcome()
        if isinstance(step, waits.Notice):
            return on_wait()
        if isinstance(step, waits.Where):
            return job_wait_detail(self.connection, self.id)
        return None  # Emit: passed on by _drive

    def _send(self, read: waits.Read) -> Any:
        if len(read.commands) == 1:
            return read.commands[0].on(self.connection)
        with self.connection.pipeline(transaction=False) as pipe:
            return read.queue(pipe).execute()

    def cancel(self) -> bool:
        """Ask for the job to be canceled; False if it had already ended.

        A queued job is canceled at once (rq's `job.cancel()`); a running one is stopped by
        its worker at its next step, which frees its KV blocks. `result()` then raises
        JobCanceledError.
        """
        job = self.job()
        status = job.get_status()
        if status in TERMINAL_STATUSES:
            return False
        # The flag first: a worker that dequeues the job at this very moment still sees it.
        self.connection.set(cancel_key(self.id), 1, ex=CANCEL_FLAG_TTL_S)
        if status == JobStatus.STARTED:
            with contextlib.suppress(
                InvalidJobOperation, NoSuchJobError
            ):  # not running after all: the flag covers it
                send_stop_job_command(self.connection, self.id, serializer=self._serializer)
            return True
        try:
            job.cancel()
        except InvalidJobOperation:
            return False
        return True

    def events(self, timeout: float | None = None, *, on_wait: OnWait | None = None) -> Iterator[StreamEvent]:
        """Every event of the job's token stream, from the start, ending with an end or error event.

        `on_wait` as for `result()`: called about every second that brings no event.
        """
        run = waits.Run(waits.events(self.id, self.tenant, timeout))
        yield from self._drive(run, on_wait or _UnheardJobWarning(self))

    def stream(self, timeout: float | None = None, *, on_wait: OnWait | None = None) -> Iterator[str]:
        """Text deltas as the worker generates them (from the start, also for a late reader).

        Raises JobFailedError if the job fails; ends quietly when it is canceled. A job run
        again after a worker crash or drain streams again from its start: the text already
        yielded is skipped, which is exact for greedy or seeded requests.
        """
        replay = Replay()
        for event in self.events(timeout=timeout, on_wait=on_wait):
            fresh = replay.fresh(event)
            if fresh is None:
                continue
            if fresh.kind == "delta" and fresh.text:
                yield fresh.text
            elif fresh.kind == "error":
                raise self._stream_failure(fresh)

    def fresh_events(
        self, timeout: float | None = None, *, on_wait: OnWait | None = None
    ) -> Iterator[StreamEvent]:
        """`events()` with what a re-run repeats left out (outcome.Replay), as `stream()` reads them."""
        replay = Replay()
        for event in self.events(timeout=timeout, on_wait=on_wait):
            fresh = replay.fresh(event)
            if fresh is not None:
                yield fresh

    def _stream_failure(self, event: StreamEvent) -> JobFailedError:
        """The error a failed stream ends with: the code its error event carries, else (an older
        worker's event) the one the job recorded in rq, waited for a moment (waits.failure)."""
        failed = self._run(waits.failure(self.id, event, waits.STREAM_FAILURE_WAIT_S))
        return failed if failed is not None else JobFailedError(self.id, event.error or "failed")


class _UnheardJobWarning:
    """Logs a warning, once, when a job still waits after FIRST_NOTICE_S in a queue no live worker
    listens on: a wait that would otherwise end only at its timeout, or never, without a word."""

    def __init__(self, handle: JobHandle) -> None:
        self.handle = handle
        self.started = time.monotonic()
        self.warned = False

    def __call__(self) -> None:
        if self.warned or time.monotonic() - self.started < liveness.FIRST_NOTICE_S:
            return
        queue = unheard_queue(self.handle.connection, self.handle.id)
        if queue is not None:
            self.warned = True
            logger.warning("job %s waits: %s", self.handle.id, no_worker_line(queue))


class Producer:
    """Enqueue kvrq generation jobs into an rq queue (JSON-serialized)."""

    def __init__(
        self,
        redis_url: str | None = None,
        queue: str = DEFAULT_QUEUE,
        *,
        connection: Redis | None = None,
        default_job_timeout: int = DEFAULT_JOB_TIMEOUT,
        affinity: bool = True,
        tenant: str | Tenant | None = None,
    ) -> None:
        """`affinity`: send an agent's job to the worker that holds its cache hot (that worker's own
        queue, drained before the shared one), when that worker is alive; else to the shared queue.
        `tenant`: the jobs are that tenant's (its own agents and prefix reuse, walled from every other
        tenant's and from tenant-less jobs; producer/tenants.py); results show the client's agent ids."""
        if connection is None:
            if redis_url is None:
                raise ValueError("give redis_url or connection")
            connection = connect(redis_url)
        self.connection = connection
        self.queue_name = queue
        self.default_job_timeout = default_job_timeout
        self.affinity = affinity
        self.tenant = tenant_of(tenant)
        self.writer = JobWriter(connection, queue, default_job_timeout)

    def close(self) -> None:
        self.connection.close()

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def queue(self, name: str | None = None) -> Queue:
        return self.writer.queue(name)

    def handle(self, job_id: str) -> JobHandle:
        return JobHandle(self.connection, job_id, tenant=self.tenant)

    def conversation(self, agent_id: str) -> list[dict[str, Any]] | None:
        """The agent's messages as of its last finished chat job (OpenAI's chat shape, its answers
        included), or None when it has none: what a `continue` job appends to."""
        if self.tenant is not None:
            agent_id = self.tenant.agent(agent_id)
        record = read_conversation(self.connection, agent_id)
        return None if record is None else record.message_dicts()

    def submit(
        self, request: GenerationRequest | Mapping[str, Any], *, job_id: str | None = None
    ) -> JobHandle:
        """Validate, enqueue one request; with `job_id`, a job that already exists is not enqueued again."""
        return self.submit_many([request], job_ids=None if job_id is None else [job_id])[0]

    def submit_many(
        self,
        requests: Iterable[GenerationRequest | Mapping[str, Any]],
        *,
        job_ids: Sequence[str] | None = None,
    ) -> list[JobHandle]:
        """Validate all requests first (none is enqueued if one is invalid), then enqueue in one round trip.

        With `job_ids`, ids that already name a job get a handle to that job instead of a new one,
        so a resubmission after a crash is idempotent.

        A Redis primary failing over is ridden out (producer.wire.redis_url.retry_unsent); with a Sentinel
        URL the call returns once a replica holds the jobs too (`wait`), else raises ConnectionError.
        """
        checked = validated(list(requests), self.tenant)
        if job_ids is not None and len(job_ids) != len(checked):
            raise ValueError(f"{len(job_ids)} job ids for {len(checked)} requests")
        handles = retry_unsent(lambda: self._submit(checked, job_ids))
        wait_replicated(self.connection, [Job.key_for(handle.id) for handle in handles])
        return handles

    def _submit(self, requests: list[GenerationRequest], job_ids: Sequence[str] | None) -> list[JobHandle]:
        homes = self._homes(requests)
        if job_ids is None:
            # MULTI/EXEC: a job's hash is never on a server without its queue entry (wait_replicated
            # checks the hash after a failover).
            with self.connection.pipeline(transaction=True) as pipe:
                ids = [self.writer.enqueue(request, None, pipe, homes) for request in requests]
                pipe.execute()
            return [self.handle(job_id) for job_id in ids]
        keys = [Job.key_for(job_id) for job_id in job_ids]
        with self.connection.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(*keys)
                    exists = [bool(pipe.exists(key)) for key in keys]
                    pipe.multi()
                    for request, job_id, existing in zip(requests, job_ids, exists, strict=True):
                        if not existing:
                            self.writer.enqueue(request, job_id, pipe, homes)
                    pipe.execute()
                    break
                except WatchError as exc:
                    if isinstance(exc.__context__, UNSENT):
                        raise exc.__context__ from None  # not a race: the primary refused (retry_unsent)
                    continue  # another producer touched one of these ids: look again
        return [self.handle(job_id) for job_id in job_ids]

    def _homes(self, requests: Sequence[GenerationRequest]) -> dict[str, str]:
        """agent id -> the live worker holding its cache hot (enqueue.placing's reads, sent here)."""
        run = waits.Run(placing(requests, self.affinity))
        while isinstance(step := run.step, waits.Read):
            run.settle(partial(step.commands[0].on, self.connection))
        return run.value
