"""The producer's blocking client, driven from async code: submit, wait, follow the stream, cancel.

`JobHandle` reads Redis with blocking calls (XREAD with a one-second block); each wait runs on a thread
of the bridge's own pool, so many open streams never starve the event loop or each other. A wait ends
early when its `stop` flag is set (the client went away): the handle's `on_wait` callback, called about
every second of waiting, raises then.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from typing import Any, TypeVar

from redis.exceptions import RedisError

from producer.client import JobFailedError, JobHandle, JobNotFoundError, Producer, ResultTimeoutError
from producer.http.errors import APIError, from_job_failure
from producer.models import GenerationRequest, GenerationResult
from producer.wire.protocol import StreamEvent

T = TypeVar("T")
logger = logging.getLogger("kvrq.http")

#: Threads that wait on Redis for the server's open requests (each open request holds one while it waits).
DEFAULT_THREADS = 512
#: Seconds to wait for the result of a job whose stream has ended (the worker writes the end marker first).
RESULT_AFTER_END_S = 5.0


class ClientGone(Exception):
    """The HTTP client disconnected before its job ended; the job has been canceled."""


class _Stopped(Exception):
    pass


class Bridge:
    def __init__(self, producer: Producer, *, threads: int = DEFAULT_THREADS) -> None:
        self.producer = producer
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix="kvrq-http")

    def close(self) -> None:
        """At shutdown: the cancels of the requests the server cut off still go out (queued calls run;
        the waits end within a poll, their stop flags set)."""
        self.executor.shutdown(wait=False)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, partial(fn, *args))

    async def submit(self, request: GenerationRequest) -> JobHandle:
        return await self.run(self.producer.submit, request)

    def cancel_soon(self, handle: JobHandle) -> None:
        """Cancel the job on a thread, not waiting: for where nothing can be awaited (a closing stream)."""
        try:
            self.executor.submit(_cancel, handle)
        except RuntimeError:  # the server is stopping and its pool takes no more work: a thread of its own
            threading.Thread(target=_cancel, args=(handle,), name="kvrq-http-cancel").start()

    async def result(self, handle: JobHandle, *, timeout: float, gone: Awaitable[object]) -> GenerationResult:
        """The job's result; APIError when it fails, or times out (it is canceled); ClientGone when
        `gone` completes first (the client disconnected: the job is canceled)."""
        stop = threading.Event()
        try:
            return await self.race(
                handle, self.run(partial(handle.result, timeout, on_wait=partial(_check, stop))), gone
            )
        except JobFailedError as exc:
            raise from_job_failure(exc) from None
        except ResultTimeoutError:
            raise self.timed_out(handle, timeout) from None
        finally:
            stop.set()

    async def first(
        self,
        handle: JobHandle,
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

    async def race(self, handle: JobHandle, work: Awaitable[T], gone: Awaitable[object]) -> T:
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

    def timed_out(self, handle: JobHandle, timeout: float) -> APIError:
        """504 for a job that did not end in time; the job is canceled."""
        self.cancel_soon(handle)
        return APIError(504, f"job {handle.id} did not end within {timeout:g} s", code="timeout")

    async def result_after_end(self, handle: JobHandle) -> GenerationResult | None:
        """The result of a job whose stream ended with `end`; None if it has none (canceled, expired)."""
        try:
            return await self.run(handle.result, RESULT_AFTER_END_S)
        except (JobFailedError, ResultTimeoutError, JobNotFoundError):
            return None

    async def failure(self, handle: JobHandle, reason: str) -> APIError:
        """The error of a job whose stream ended with `error`, with the code its worker recorded."""
        try:
            await self.run(handle.result, RESULT_AFTER_END_S)
        except JobFailedError as exc:
            return from_job_failure(exc)
        except (ResultTimeoutError, JobNotFoundError):
            pass
        return APIError(500, f"job {handle.id} failed: {reason}", code="job_failed")

    async def events(self, handle: JobHandle, *, timeout: float) -> AsyncIterator[StreamEvent]:
        """The job's stream events, what a re-run repeats left out (Replay); ends after `end` or `error`.

        Raises ResultTimeoutError when no end comes within `timeout` seconds.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[StreamEvent | BaseException | None] = asyncio.Queue()
        stop = threading.Event()

        def pump() -> None:
            try:
                for event in handle.events(timeout, on_wait=partial(_check, stop)):
                    loop.call_soon_threadsafe(queue.put_nowait, event)
                    if stop.is_set():
                        break
            except _Stopped:
                pass
            except BaseException as exc:  # handed to the reader, which raises it
                loop.call_soon_threadsafe(queue.put_nowait, exc)
            finally:
                loop.call_soon_threadsafe(queue.put_nowait, None)

        loop.run_in_executor(self.executor, pump)
        replay = Replay()
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                event = replay.fresh(item)
                if event is not None:
                    yield event
        finally:
            stop.set()


class Replay:
    """Leaves out what a re-run repeats: a job started again after a worker crash or drain streams again
    from its start (`start` event); the text, calls and logprobs already passed on are skipped (exact for
    greedy or seeded requests, as `JobHandle.stream()`). A stream with tool calls ends "tool_calls"."""

    def __init__(self) -> None:
        self.sent: Counter[str] = Counter()
        self.attempt: Counter[str] = Counter()

    def fresh(self, event: StreamEvent) -> StreamEvent | None:
        kind = event.kind
        if kind == "start":
            self.attempt.clear()
            return None
        if kind in ("delta", "reasoning"):
            skip = max(0, self.sent[kind] - self.attempt[kind])
            self.attempt[kind] += len(event.text)
            if skip >= len(event.text):
                return None
            self.sent[kind] += len(event.text) - skip
            return replace(event, text=event.text[skip:]) if skip else event
        if kind in ("tool_call", "logprobs"):
            self.attempt[kind] += 1
            if self.attempt[kind] <= self.sent[kind]:
                return None
            self.sent[kind] += 1
        return event


def _check(stop: threading.Event) -> None:
    if stop.is_set():
        raise _Stopped


def _consume(future: asyncio.Future[Any]) -> None:
    """Reads the outcome of a wait nobody awaits any more (asyncio would log it as never retrieved)."""
    if not future.cancelled():
        future.exception()


def _cancel(handle: JobHandle) -> None:
    try:
        if handle.cancel():
            logger.info("job %s: canceled (the client went away or its time ran out)", handle.id)
    except (JobNotFoundError, RedisError) as exc:
        logger.warning("job %s: could not cancel: %s", handle.id, exc)


async def disconnected(receive: Callable[[], Awaitable[Any]]) -> None:
    """Returns once the client has disconnected (call only after the request body has been read)."""
    while True:
        message = await receive()
        if message.get("type") == "http.disconnect":
            return
