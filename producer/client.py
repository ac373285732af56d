"""Producer: enqueue generation jobs as plain rq jobs and follow them (result, status, stream, cancel).

Only redis, rq and pydantic are needed here: a web app that enqueues jobs never imports MLX.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from redis import Redis
from redis.exceptions import WatchError
from rq import Queue, Retry
from rq.command import send_stop_job_command
from rq.exceptions import InvalidJobOperation, NoSuchJobError
from rq.job import Job, JobStatus
from rq.results import Result
from rq.serializers import resolve_serializer

from producer import liveness
from producer.conversation import read_conversation
from producer.liveness import job_wait_detail, no_worker_line, unheard_queue
from producer.models import GenerationRequest, GenerationResult
from producer.tenants import Tenant, tenant_of
from producer.wire.protocol import (
    CANCEL_FLAG_TTL_S,
    DEFAULT_QUEUE,
    JOB_FUNCTION,
    SERIALIZER,
    ErrorCode,
    StreamEvent,
    agent_home_key,
    cancel_key,
    failure_of,
    stream_key,
    worker_alive_key,
    worker_queue_name,
)
from producer.wire.redis_url import REDIS_DOWN, UNSENT, connect, retry_unsent, wait_replicated
from producer.wire.text import as_text

logger = logging.getLogger("kvrq.producer")

#: Seconds a started job may run when the request names no job_timeout (rq's own default is 180).
DEFAULT_JOB_TIMEOUT = 600
TERMINAL_STATUSES = frozenset({JobStatus.FINISHED, JobStatus.FAILED, JobStatus.CANCELED, JobStatus.STOPPED})
_POLL_S = 1.0
_STREAM_FAILURE_WAIT_S = 2.0


class JobFailedError(Exception):
    """The job ended without a result; `reason` is the worker's one-line reason.

    `code` says why in a form to decide on: an ErrorCode value (protocol.py) the worker recorded,
    ErrorCode.INTERNAL when it recorded none; "canceled" for JobCanceledError.
    """

    def __init__(
        self,
        job_id: str,
        reason: str,
        *,
        status: str = "failed",
        details: str | None = None,
        code: str = ErrorCode.INTERNAL,
    ) -> None:
        self.job_id = job_id
        self.reason = reason
        self.status = status
        self.details = details or reason
        self.code = code
        super().__init__(f"job {job_id} {status} ({code}): {reason}")


class JobCanceledError(JobFailedError):
    """The job was canceled before it finished."""

    def __init__(self, job_id: str) -> None:
        super().__init__(job_id, "canceled", status="canceled", code="canceled")


class JobNotFoundError(LookupError):
    """No such job in Redis (never enqueued, or its TTL ran out)."""


class ResultTimeoutError(TimeoutError):
    """The job did not end within the given timeout; it keeps running."""


def job_failure(connection: Redis, job_id: str) -> tuple[str, str, str | None]:
    """(code, one-line reason, rq's exc_string) of a failed job: the worker's structured error in
    job.meta when it wrote one, else what rq recorded (protocol.failure_of)."""
    serializer = resolve_serializer(SERIALIZER)
    latest = Result.fetch_latest(Job(job_id, connection=connection), serializer=serializer)
    details = latest.exc_string if latest is not None else None
    raw_meta = connection.hget(Job.key_for(job_id), "meta")
    if isinstance(raw_meta, str):
        raw_meta = raw_meta.encode()
    try:
        meta = serializer.loads(raw_meta) if raw_meta else None
    except ValueError:  # meta written by a foreign client in another serializer: no kvrq error in it
        meta = None
    code, reason = failure_of(meta if isinstance(meta, dict) else None, details)
    return code, reason, details


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
        raw = retry_unsent(lambda: self.connection.hget(Job.key_for(self.id), "status"), errors=REDIS_DOWN)
        if raw is None:
            raise JobNotFoundError(f"no job {self.id} in Redis")
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    def meta(self) -> dict[str, Any]:
        """rq's job.meta; the worker keeps `progress` (phase, tokens so far) there."""
        return dict(self.job().get_meta())

    def result(
        self, timeout: float | None = None, *, on_wait: Callable[[], object] | None = None
    ) -> GenerationResult:
        """Wait for the job to end; return its result or raise JobFailedError / JobCanceledError.

        Raises ResultTimeoutError when `timeout` seconds pass first (the job goes on); its message
        says where the job stands (e.g. queued where no live worker listens). `on_wait` is called
        about every second of waiting; by default a warning is logged, once, when the job still
        waits after a few seconds in a queue no live worker listens on.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        waiting = on_wait or _UnheardJobWarning(self)
        results_key = Result.get_key(self.id)
        while True:
            # The results stream's last entry is read before the status: a result written after the
            # status read lies past it and wakes the wait below at once (read after the status, the
            # wait could take that very result for an old one and sleep a whole poll).
            latest: Any = retry_unsent(
                lambda: self.connection.xrevrange(results_key, "+", "-", count=1), errors=REDIS_DOWN
            )
            last_id = latest[0][0] if latest else "0-0"
            outcome = self._outcome()
            if outcome is not None:
                return outcome
            block = _POLL_S if deadline is None else min(_POLL_S, deadline - time.monotonic())
            if block <= 0:
                raise self._timed_out(timeout)
            waiting()
            # Woken as soon as the worker writes a result; the poll catches cancels (no result).
            self._read(results_key, last_id, block=block, count=1)

    def _outcome(self) -> GenerationResult | None:
        status = self.status()
        if status == JobStatus.CANCELED:
            raise JobCanceledError(self.id)
        if status not in (JobStatus.FINISHED, JobStatus.FAILED, JobStatus.STOPPED):
            return None
        if status == JobStatus.FINISHED:
            job = Job(self.id, connection=self.connection)
            latest = Result.fetch_latest(job, serializer=self._serializer)
            if latest is None or latest.type != Result.Type.SUCCESSFUL:
                raise JobFailedError(self.id, "finished, but its result has expired", status="expired")
            result = GenerationResult.model_validate(latest.return_value)
            return result if self.tenant is None else self.tenant.result(result)
        code, reason, details = job_failure(self.connection, self.id)
        if self.tenant is not None:
            reason, details = self.tenant.unqualified(reason), self.tenant.unqualified(details or reason)
        raise JobFailedError(self.id, reason, status=status, details=details, code=code)

    def _read(
        self, key: str, last_id: bytes | str, *, block: float | None, count: int
    ) -> list[tuple[bytes, dict[bytes, bytes]]]:
        """Entries of one stream after `last_id`, waiting up to `block` seconds for the first."""
        block_ms = None if block is None else max(1, int(block * 1000))
        response: Any = retry_unsent(
            lambda: self.connection.xread({key: last_id}, block=block_ms, count=count), errors=REDIS_DOWN
        )
        return list(response[0][1]) if response else []

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

    def _timed_out(self, timeout: float | None) -> ResultTimeoutError:
        return ResultTimeoutError(
            f"job {self.id} did not end within {timeout} s: {job_wait_detail(self.connection, self.id)}"
        )

    def events(
        self, timeout: float | None = None, *, on_wait: Callable[[], object] | None = None
    ) -> Iterator[StreamEvent]:
        """Every event of the job's token stream, from the start, ending with an end or error event.

        `on_wait` as for `result()`: called about every second that brings no event.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        waiting = on_wait or _UnheardJobWarning(self)
        key = stream_key(self.id)
        last_id: bytes | str = "0-0"
        seen_any = False
        while True:
            block = _POLL_S if deadline is None else min(_POLL_S, deadline - time.monotonic())
            if block <= 0:
                raise self._timed_out(timeout)
            entries = self._read(key, last_id, block=block, count=1024)
            if entries:
                for entry_id, fields in entries:
                    last_id = entry_id
                    seen_any = True
                    event = self._seen(StreamEvent.from_fields(fields))
                    yield event
                    if event.final:
                        return
                continue
            ending = self._ending_without_stream(key, last_id, seen_any)
            if ending is not None:
                yield from ending
                return
            waiting()

    def _seen(self, event: StreamEvent) -> StreamEvent:
        """An event as the handle's tenant sees it (an error's text unqualified)."""
        if self.tenant is None or event.kind != "error" or not event.error:
            return event
        return StreamEvent("error", error=self.tenant.unqualified(event.error))

    def _ending_without_stream(
        self, key: str, last_id: bytes | str, seen_any: bool
    ) -> list[StreamEvent] | None:
        """Events that close a stream that will never get its end marker, or None to keep waiting.

        A job canceled in the queue, or failed before a worker took it, never had a stream;
        a stream may also have expired before a late reader came.
        """
        try:
            status = self.status()
        except JobNotFoundError:
            return [StreamEvent("error", error=f"no job {self.id} in Redis")]
        if status not in TERMINAL_STATUSES:
            return None
        # The worker writes the end marker before it finishes the rq job: read what is left.
        rest = self._read(key, last_id, block=None, count=100_000)
        if rest:
            events = [self._seen(StreamEvent.from_fields(fields)) for _, fields in rest]
            if events and events[-1].final:
                return events
        if status == JobStatus.CANCELED:
            return [StreamEvent("end", finish_reason="canceled")]
        try:
            result = self.result(timeout=0.001)
        except JobFailedError as exc:
            return [StreamEvent("error", error=exc.reason)]
        head = [] if seen_any else _result_events(result)
        return [*head, StreamEvent("end", finish_reason=result.finish_reason)]

    def stream(
        self, timeout: float | None = None, *, on_wait: Callable[[], object] | None = None
    ) -> Iterator[str]:
        """Text deltas as the worker generates them (from the start, also for a late reader).

        Raises JobFailedError if the job fails; ends quietly when it is canceled. A job run
        again after a worker crash or drain streams again from its start: the text already
        yielded is skipped, which is exact for greedy or seeded requests.
        """
        yielded = 0  # characters handed to the caller
        attempt_chars = 0  # characters the current attempt has produced
        for event in self.events(timeout=timeout, on_wait=on_wait):
            if event.kind == "start":
                attempt_chars = 0
            elif event.kind == "delta" and event.text:
                skip = max(0, yielded - attempt_chars)
                attempt_chars += len(event.text)
                if skip < len(event.text):
                    yielded += len(event.text) - skip
                    yield event.text[skip:]
            elif event.kind == "error":
                raise self._stream_failure(event.error or "failed")

    def _stream_failure(self, reason: str) -> JobFailedError:
        """The error a failed stream ends with, with the job's structured code.

        The worker writes the stream's error event just before rq marks the job failed: wait a
        moment for that, so the code is the one the worker recorded.
        """
        try:
            self.result(timeout=_STREAM_FAILURE_WAIT_S)
        except JobFailedError as exc:
            return exc
        except (ResultTimeoutError, JobNotFoundError):
            pass
        return JobFailedError(self.id, reason)


def _result_events(result: GenerationResult) -> list[StreamEvent]:
    """A finished job's events rebuilt from its result, for a stream that expired before it was read."""
    events = [StreamEvent("reasoning", text=result.reasoning)] if result.reasoning else []
    events.append(StreamEvent("delta", text=result.text))
    events += [
        StreamEvent("tool_call", data=call.model_dump(mode="json")) for call in result.tool_calls or ()
    ]
    return events


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
        self._queues: dict[str, Queue] = {}

    def close(self) -> None:
        self.connection.close()

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def queue(self, name: str | None = None) -> Queue:
        name = name or self.queue_name
        if name not in self._queues:
            self._queues[name] = Queue(name, connection=self.connection, serializer=SERIALIZER)
        return self._queues[name]

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
        validated = [_validate(request) for request in requests]
        if self.tenant is not None:
            validated = [self.tenant.request(request) for request in validated]
        if job_ids is not None and len(job_ids) != len(validated):
            raise ValueError(f"{len(job_ids)} job ids for {len(validated)} requests")
        handles = retry_unsent(lambda: self._submit(validated, job_ids))
        wait_replicated(self.connection, [Job.key_for(handle.id) for handle in handles])
        return handles

    def _submit(self, validated: list[GenerationRequest], job_ids: Sequence[str] | None) -> list[JobHandle]:
        homes = self._homes(validated)
        if job_ids is None:
            # MULTI/EXEC: a job's hash is never on a server without its queue entry (wait_replicated
            # checks the hash after a failover).
            with self.connection.pipeline(transaction=True) as pipe:
                jobs = [self._enqueue(request, None, pipe, homes) for request in validated]
                pipe.execute()
            return [self.handle(job.id) for job in jobs]
        keys = [Job.key_for(job_id) for job_id in job_ids]
        with self.connection.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(*keys)
                    exists = [bool(pipe.exists(key)) for key in keys]
                    pipe.multi()
                    for request, job_id, existing in zip(validated, job_ids, exists, strict=True):
                        if not existing:
                            self._enqueue(request, job_id, pipe, homes)
                    pipe.execute()
                    break
                except WatchError as exc:
                    if isinstance(exc.__context__, UNSENT):
                        raise exc.__context__ from None  # not a race: the primary refused (retry_unsent)
                    continue  # another producer touched one of these ids: look again
        return [self.handle(job_id) for job_id in job_ids]

    def _homes(self, requests: Sequence[GenerationRequest]) -> dict[str, str]:
        """agent id -> the live worker holding its cache hot, for the agents among `requests`."""
        agents = sorted({r.agent_id for r in requests if r.agent_id is not None}) if self.affinity else []
        if not agents:
            return {}
        found = self.connection.mget([agent_home_key(agent) for agent in agents])
        homes = {agent: as_text(worker) for agent, worker in zip(agents, found, strict=True) if worker}
        workers = sorted({worker for worker in homes.values() if worker})
        if not workers:
            return {}
        beats = self.connection.mget([worker_alive_key(worker) for worker in workers])
        alive = {worker for worker, beat in zip(workers, beats, strict=True) if beat}
        return {agent: worker for agent, worker in homes.items() if worker in alive}

    def _enqueue(
        self, request: GenerationRequest, job_id: str | None, pipe: Any, homes: Mapping[str, str]
    ) -> Job:
        retry = Retry(max=request.retries) if request.retries else None
        who = request.agent_id or "one-off"
        queue = request.queue or self.queue_name
        home = homes.get(request.agent_id) if request.agent_id is not None else None
        if home is not None:
            queue = worker_queue_name(queue, home)
        return self.queue(queue).enqueue_call(
            JOB_FUNCTION,
            args=(request.job_payload(),),
            timeout=request.job_timeout or self.default_job_timeout,
            result_ttl=request.result_ttl,
            job_id=job_id,
            at_front=request.at_front,
            retry=retry,
            meta={"agent_id": request.agent_id},
            description=f"kvrq generate ({who}, max_tokens={request.max_tokens})",
            pipeline=pipe,
        )


def _validate(request: GenerationRequest | Mapping[str, Any]) -> GenerationRequest:
    if isinstance(request, GenerationRequest):
        return GenerationRequest.model_validate(request.model_dump())
    return GenerationRequest.model_validate(dict(request))
