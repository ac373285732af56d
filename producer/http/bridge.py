"""The server's side of a job: submit, wait, follow the stream, cancel, with the asyncio producer.

Every wait is an AsyncJobHandle's (producer/aio.py): awaited on the event loop, holding a Redis
connection, no thread. A wait ends early when the client goes away (`race`: the job is canceled) or the
request times out (504: the job is canceled). The few reads that only rq's blocking API makes (the
pools' worker list, the Responses records) run on asyncio's default executor (`run`), a handful of
threads, never held through a wait.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any, TypeVar

from redis import Redis
from redis.exceptions import RedisError

from producer.aio import AsyncJobHandle, AsyncProducer
from producer.errors import JobFailedError, JobNotFoundError, ResultTimeoutError
from producer.http.errors import APIError, from_job_failure
from producer.models import GenerationRequest, GenerationResult
from producer.wire.protocol import StreamEvent

T = TypeVar("T")
logger = logging.getLogger("kvrq.http")

#: Seconds to wait for the rq result of a job whose stream has ended where its end event does not carry what
#: is read (the worker writes the end marker first).
RESULT_AFTER_END_S = 5.0
#: Seconds the server, stopping, waits for the cancels it has sent out.
CLOSE_WAIT_S = 5.0
#: Seconds the server, stopping, lets the requests it cut off start their cancels.
CANCELS_START_S = 0.2


class ClientGone(Exception):
    """The HTTP client disconnected before its job ended; the job has been canceled."""


class Bridge:
    def __init__(self, producer: AsyncProducer, blocking: Redis) -> None:
        """`blocking`: the client for rq's blocking reads (`run`) and cancels."""
        self.producer = producer
        self.blocking = blocking
        self._cancels: set[asyncio.Task[None]] = set()

    async def close(self) -> None:
        """At shutdown: the cancels of the requests the server cut off still go out. uvicorn cancels
        those requests just before this runs, and a request learns of it only some turns of the loop
        later (through the middleware's task groups): it is given CANCELS_START_S to start its cancel."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CLOSE_WAIT_S
        await asyncio.sleep(CANCELS_START_S)
        while self._cancels and loop.time() < deadline:
            await asyncio.wait(set(self._cancels), timeout=deadline - loop.time())

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """A short blocking call (rq's reads) on the default executor."""
        return await asyncio.to_thread(partial(fn, *args))

    async def submit(self, request: GenerationRequest) -> AsyncJobHandle:
        return await self.producer.submit(request)

    def cancel_soon(self, handle: AsyncJobHandle) -> None:
        """Cancel the job, not waiting: for where nothing can be awaited (a closing stream)."""
        try:
            task = asyncio.get_running_loop().create_task(_cancel(handle))
        except RuntimeError:  # no loop running any more (the server stopped): a thread of its own
            threading.Thread(target=asyncio.run, args=(_cancel(handle),), name="kvrq-http-cancel").start()
            return
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)

    async def result(
        self, handle: AsyncJobHandle, *, timeout: float, gone: Awaitable[object]
    ) -> GenerationResult:
        """The job's result; APIError when it fails, or times out (it is canceled); ClientGone when
        `gone` completes first (the client disconnected: the job is canceled)."""
        try:
            return await self.race(handle, handle.result(timeout, on_wait=_quiet), gone)
        except JobFailedError as exc:
            raise from_job_failure(exc) from None
        except ResultTimeoutError:
            raise self.timed_out(handle, timeout) from None

    async def first(
        self,
        handle: AsyncJobHandle,
        events: AsyncIterator[StreamEvent],
        *,
        timeout: float,
        gone: Awaitable[object],
    ) -> StreamEvent:
        """The first event of `events` (Bridge.events: the first token, or the end, or the error), with
        the same outcomes as `result`."""
        try:
            return await self.race(handle, anext(events), gone)
        except ResultTimeoutError:
            raise self.timed_out(handle, timeout) from None

    async def race(self, handle: AsyncJobHandle, work: Awaitable[T], gone: Awaitable[object]) -> T:
        """`work`'s outcome, unless `gone` completes first: then the job is canceled and ClientGone raised.
        A request cancelled while it waits (the server stopping) cancels its job too."""
        task = asyncio.ensure_future(work)
        task.add_done_callback(_consume)
        watching = asyncio.ensure_future(gone)
        try:
            done, _ = await asyncio.wait({task, watching}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            self.cancel_soon(handle)
            raise
        finally:
            watching.cancel()
        if task not in done:
            task.cancel()
            self.cancel_soon(handle)
            raise ClientGone(handle.id)
        return task.result()

    def timed_out(self, handle: AsyncJobHandle, timeout: float) -> APIError:
        """504 for a job that did not end in time; the job is canceled."""
        self.cancel_soon(handle)
        return APIError(504, f"job {handle.id} did not end within {timeout:g} s", code="timeout")

    async def result_after_end(self, handle: AsyncJobHandle) -> GenerationResult | None:
        """The rq result of a job whose stream ended with `end`, for what the end event does not carry
        (sse._tail); None if it has none (canceled, expired)."""
        try:
            return await handle.result(RESULT_AFTER_END_S, on_wait=_quiet)
        except (JobFailedError, ResultTimeoutError, JobNotFoundError):
            return None

    async def failure(self, handle: AsyncJobHandle, error: StreamEvent) -> APIError:
        """The error of a job whose stream ended with the `error` event, with its worker's code: the one the
        event carries, else (an older worker's event) the one it recorded in rq, waited for up to
        RESULT_AFTER_END_S (AsyncJobHandle.failure)."""
        failed = await handle.failure(error, RESULT_AFTER_END_S)
        if failed is not None:
            return from_job_failure(failed)
        return APIError(500, f"job {handle.id} failed: {error.error or 'failed'}", code="job_failed")

    def events(self, handle: AsyncJobHandle, *, timeout: float) -> AsyncIterator[StreamEvent]:
        """The job's stream events, what a re-run repeats left out (AsyncJobHandle.fresh_events); ends
        after `end` or `error`. Raises ResultTimeoutError when no end comes within `timeout` seconds."""
        return handle.fresh_events(timeout, on_wait=_quiet)


def _quiet() -> None:
    """The server's waits log no "no worker listens" notice: a request without a worker is a 503."""


def _consume(future: asyncio.Future[Any]) -> None:
    """Reads the outcome of a wait nobody awaits any more (asyncio would log it as never retrieved)."""
    if not future.cancelled():
        future.exception()


async def _cancel(handle: AsyncJobHandle) -> None:
    try:
        if await handle.cancel():
            logger.info("job %s: canceled (the client went away or its time ran out)", handle.id)
    except (JobNotFoundError, RedisError) as exc:
        logger.warning("job %s: could not cancel: %s", handle.id, exc)


async def disconnected(receive: Callable[[], Awaitable[Any]]) -> None:
    """Returns once the client has disconnected (call only after the request body has been read)."""
    while True:
        message = await receive()
        if message.get("type") == "http.disconnect":
            return
