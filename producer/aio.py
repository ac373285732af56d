"""The asyncio producer: AsyncProducer and AsyncJobHandle, for web apps (FastAPI, Starlette, aiohttp)
and `kvrq serve`. Same jobs, same guarantees as the blocking client (client.py), no thread per wait.

What both clients decide is decided once: what an enqueue writes (enqueue.py: rq's own writes, recorded
and sent here on a redis.asyncio pipeline), how they wait (waits.py: the deadline, the order of the
reads, what a stream's final event means; each client only answers the waits' steps, blocking or
awaited), what a job's state means (outcome.py: result, failure, the stream's end, the re-run skipping of
`stream()`), how a Redis URL connects and rides out a failover (wire/redis_url_aio.py).

rq is synchronous; the one call that goes through it here is `cancel()` (rq's own cancel, which reads
and writes several of rq's keys): it runs on a thread with a blocking client of the same URL.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from redis import Redis
from redis.asyncio import Redis as AsyncRedis
from redis.exceptions import WatchError
from rq.job import Job
from rq.serializers import resolve_serializer

from producer import liveness, waits
from producer.client import JobHandle
from producer.conversation import read_conversation
from producer.enqueue import DEFAULT_JOB_TIMEOUT, JobWriter, NoConnection, Recorder, placing, validated
from producer.errors import JobFailedError, JobNotFoundError
from producer.models import GenerationRequest, GenerationResult
from producer.outcome import Replay
from producer.tenants import Tenant, tenant_of
from producer.wire.protocol import DEFAULT_QUEUE, SERIALIZER, StreamEvent
from producer.wire.redis_url import REDIS_DOWN, UNSENT, connect
from producer.wire.redis_url_aio import connect_async, retry_unsent_async, wait_replicated_async

logger = logging.getLogger("kvrq.producer")

#: Connections of an AsyncProducer's own pool (redis-py's default).
DEFAULT_MAX_CONNECTIONS = 100
OnWait = Callable[[], object]
T = TypeVar("T")


class AsyncJobHandle:
    """A submitted job, read with redis.asyncio: JobHandle's methods, awaited.

    `blocking`: a blocking client of the same Redis, for `cancel()` (rq's) and the waits' "no worker
    listens" notice; without one, `cancel()` raises RuntimeError and no notice is logged.
    """

    def __init__(
        self,
        connection: AsyncRedis,
        job_id: str,
        *,
        tenant: Tenant | None = None,
        blocking: Redis | None = None,
    ) -> None:
        self.connection = connection
        self.id = job_id
        self.tenant = tenant
        self.blocking = blocking

    def __repr__(self) -> str:
        return f"AsyncJobHandle({self.id!r})"

    def sync(self) -> JobHandle:
        """The blocking handle of the same job (needs `blocking`)."""
        if self.blocking is None:
            raise RuntimeError("this AsyncJobHandle has no blocking client (give AsyncProducer a redis_url)")
        return JobHandle(self.blocking, self.id, tenant=self.tenant)

    async def _call(self, command: Callable[[], Any]) -> Any:
        """One read, sent again while Redis is away (failover), as the blocking handle does."""
        return await retry_unsent_async(command, errors=REDIS_DOWN)

    async def status(self) -> str:
        """rq's status string: queued, started, finished, failed, canceled, ..."""
        return await self._run(waits.status(self.id))

    async def meta(self) -> dict[str, Any]:
        """rq's job.meta; the worker keeps `progress` (phase, tokens so far) there."""
        raw = await self._call(lambda: self.connection.hget(Job.key_for(self.id), "meta"))
        if raw is None and not await self._call(lambda: self.connection.exists(Job.key_for(self.id))):
            raise JobNotFoundError(f"no job {self.id} in Redis")
        return dict(resolve_serializer(SERIALIZER).loads(raw)) if raw else {}

    async def result(
        self, timeout: float | None = None, *, on_wait: OnWait | None = None
    ) -> GenerationResult:
        """JobHandle.result, awaited: the result, or JobFailedError, JobCanceledError, ResultTimeoutError."""
        return await self._run(waits.result(self.id, timeout), on_wait or _UnheardJobWarning(self))

    async def _outcome(self) -> GenerationResult | None:
        return await self._run(waits.ended(self.id, self.tenant))

    async def _run(self, wait: waits.Wait[T], on_wait: OnWait = waits.quiet) -> T:
        """A wait without events (waits.py holds its rule), run to its value."""
        run = waits.Run(wait)
        async for _ in self._drive(run, on_wait):
            pass
        return run.value

    async def _drive(self, run: waits.Run[Any], on_wait: OnWait) -> AsyncIterator[StreamEvent]:
        """JobHandle._drive, awaited: a wait's steps answered with redis.asyncio, its events passed on."""
        while (step := run.step) is not None:
            if isinstance(step, waits.Emit):
                yield step.event
            await run.settle_async(self._answer(step, on_wait))

    async def _answer(self, step: waits.Step, on_wait: OnWait) -> Any:
        if isinstance(step, waits.Read):
            return await self._call(lambda: self._send(step))
        if isinstance(step, waits.Outcome):
            return await self._outcome()
        if isinstance(step, waits.Notice):
            return await _called(on_wait)
        if isinstance(step, waits.Where):
            return await self._where()
        return None  # Emit: passed on by _drive

    async def _send(self, read: waits.Read) -> Any:
        if len(read.commands) == 1:
            return await read.commands[0].on(self.connection)
        async with self.connection.pipeline(transaction=False) as pipe:
            return await read.queue(pipe).execute()

    async def cancel(self) -> bool:
        """JobHandle.cancel (rq's own cancel, on a thread): False if the job had already ended."""
        return await asyncio.to_thread(self.sync().cancel)

    async def _where(self) -> str:
        """Where a job that did not end in time stands (liveness.job_wait_detail, read on a thread)."""
        if self.blocking is None:
            return "still not ended"
        return await asyncio.to_thread(liveness.job_wait_detail, self.blocking, self.id)

    async def events(
        self, timeout: float | None = None, *, on_wait: OnWait | None = None
    ) -> AsyncIterator[StreamEvent]:
        """JobHandle.events, awaited: every event of the job's stream, ending with an end or error event."""
        run = waits.Run(waits.events(self.id, self.tenant, timeout))
        async for event in self._drive(run, on_wait or _UnheardJobWarning(self)):
            yield event

    async def fresh_events(
        self, timeout: float | None = None, *, on_wait: OnWait | None = None
    ) -> AsyncIterator[StreamEvent]:
        """`events()` with what a re-run repeats left out (outcome.Replay), as `stream()` reads them."""
        replay = Replay()
        async for event in self.events(timeout, on_wait=on_wait):
            fresh = replay.fresh(event)
            if fresh is not None:
                yield fresh

    async def stream(
        self, timeout: float | None = None, *, on_wait: OnWait | None = None
    ) -> AsyncIterator[str]:
        """JobHandle.stream, awaited: text deltas; raises JobFailedError if the job fails."""
        async for event in self.fresh_events(timeout, on_wait=on_wait):
            if event.kind == "delta" and event.text:
                yield event.text
            elif event.kind == "error":
                failed = await self.failure(event)
                raise failed if failed is not None else JobFailedError(self.id, event.error or "failed")

    async def failure(
        self, event: StreamEvent, wait_s: float = waits.STREAM_FAILURE_WAIT_S
    ) -> JobFailedError | None:
        """The failure of a job whose stream ended with the error `event`: the code the event carries, else
        (an older worker's event) the one the job recorded in rq, waited for up to `wait_s`; None where
        none comes (waits.failure)."""
        return await self._run(waits.failure(self.id, event, wait_s))


async def _called(on_wait: OnWait) -> None:
    """`on_wait()`, awaited when it is a coroutine function's."""
    returned = on_wait()
    if inspect.isawaitable(returned):
        await returned


class _UnheardJobWarning:
    """client._UnheardJobWarning for the asyncio handle: the liveness read (rq's) runs on a thread."""

    def __init__(self, handle: AsyncJobHandle) -> None:
        self.handle = handle
        self.started = time.monotonic()
        self.warned = False

    async def __call__(self) -> None:
        if self.warned or self.handle.blocking is None:
            return
        if time.monotonic() - self.started < liveness.FIRST_NOTICE_S:
            return
        queue = await asyncio.to_thread(liveness.unheard_queue, self.handle.blocking, self.handle.id)
        if queue is not None:
            self.warned = True
            logger.warning("job %s waits: %s", self.handle.id, liveness.no_worker_line(queue))


class AsyncProducer:
    """Producer, awaited: enqueue kvrq jobs into an rq queue and follow them with AsyncJobHandle.

    `AsyncProducer(redis_url)` opens a redis.asyncio client (and a blocking one, used only by `cancel()`
    and the notices); or give `connection` (redis.asyncio) and optionally `blocking`. Options as for
    Producer: `queue`, `default_job_timeout`, `affinity`, `tenant`.
    """

    def __init__(
        self,
        redis_url: str | None = None,
        queue: str = DEFAULT_QUEUE,
        *,
        connection: AsyncRedis | None = None,
        blocking: Redis | None = None,
        default_job_timeout: int = DEFAULT_JOB_TIMEOUT,
        affinity: bool = True,
        tenant: str | Tenant | None = None,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
    ) -> None:
        """`max_connections` (with a redis_url): the waits open at once, each holding a connection while it
        blocks; a further one waits for a free connection (a Sentinel URL's pool refuses it instead)."""
        if connection is None:
            if redis_url is None:
                raise ValueError("give redis_url or connection")
            connection = connect_async(redis_url, wait_for_connection=True, max_connections=max_connections)
            blocking = blocking or connect(redis_url)
        self.connection = connection
        self.blocking = blocking
        self.queue_name = queue
        self.affinity = affinity
        self.tenant = tenant_of(tenant)
        self.writer = JobWriter(NoConnection(), queue, default_job_timeout, recording=True)

    async def aclose(self) -> None:
        await self.connection.aclose()
        if self.blocking is not None:
            self.blocking.close()

    async def __aenter__(self) -> AsyncProducer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def handle(self, job_id: str) -> AsyncJobHandle:
        return AsyncJobHandle(self.connection, job_id, tenant=self.tenant, blocking=self.blocking)

    async def queue_length(self, name: str | None = None) -> int:
        """Jobs waiting in a queue (rq's Queue.count)."""
        key = self.writer.queue(name).key
        return int(await retry_unsent_async(lambda: self.connection.llen(key), errors=REDIS_DOWN))

    async def conversation(self, agent_id: str) -> list[dict[str, Any]] | None:
        """Producer.conversation (read on a thread with the blocking client)."""
        if self.blocking is None:
            raise RuntimeError("conversation() needs a blocking client (give AsyncProducer a redis_url)")
        if self.tenant is not None:
            agent_id = self.tenant.agent(agent_id)
        record = await asyncio.to_thread(read_conversation, self.blocking, agent_id)
        return None if record is None else record.message_dicts()

    async def submit(
        self, request: GenerationRequest | Mapping[str, Any], *, job_id: str | None = None
    ) -> AsyncJobHandle:
        """Producer.submit, awaited."""
        return (await self.submit_many([request], job_ids=None if job_id is None else [job_id]))[0]

    async def submit_many(
        self,
        requests: Iterable[GenerationRequest | Mapping[str, Any]],
        *,
        job_ids: Sequence[str] | None = None,
    ) -> list[AsyncJobHandle]:
        """Producer.submit_many, awaited: all validated first, then one MULTI/EXEC; with `job_ids`,
        idempotent; a failover is ridden out and a Sentinel URL's `wait` honoured, as there."""
        checked = validated(list(requests), self.tenant)
        if job_ids is not None and len(job_ids) != len(checked):
            raise ValueError(f"{len(job_ids)} job ids for {len(checked)} requests")
        handles = await retry_unsent_async(lambda: self._submit(checked, job_ids))
        await wait_replicated_async(self.connection, [Job.key_for(handle.id) for handle in handles])
        return handles

    async def _submit(
        self, requests: list[GenerationRequest], job_ids: Sequence[str] | None
    ) -> list[AsyncJobHandle]:
        homes = await self._homes(requests)
        if job_ids is None:
            recorder = Recorder()
            ids = [self.writer.enqueue(request, None, recorder, homes) for request in requests]
            async with self.connection.pipeline(transaction=True) as pipe:
                recorder.replay(pipe)
                await pipe.execute()
            return [self.handle(job_id) for job_id in ids]
        keys = [Job.key_for(job_id) for job_id in job_ids]
        async with self.connection.pipeline() as pipe:
            while True:
                try:
                    await pipe.watch(*keys)
                    exists = [bool(await pipe.exists(key)) for key in keys]
                    recorder = Recorder()
                    for request, job_id, existing in zip(requests, job_ids, exists, strict=True):
                        if not existing:
                            self.writer.enqueue(request, job_id, recorder, homes)
                    pipe.multi()
                    recorder.replay(pipe)
                    await pipe.execute()
                    break
                except WatchError as exc:
                    if isinstance(exc.__context__, UNSENT):
                        raise exc.__context__ from None
                    continue
        return [self.handle(job_id) for job_id in job_ids]

    async def _homes(self, requests: Sequence[GenerationRequest]) -> dict[str, str]:
        """Producer._homes, awaited: agent id -> the live worker holding its cache hot."""
        run = waits.Run(placing(requests, self.affinity))
        while isinstance(step := run.step, waits.Read):
            await run.settle_async(step.commands[0].on(self.connection))
        return run.value


__all__ = ["AsyncJobHandle", "AsyncProducer"]
