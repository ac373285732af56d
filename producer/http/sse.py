"""Server-sent events: a job's stream events translated into one API's event stream.

A translator (openai_api.ChatStream, openai_api.CompletionStream, anthropic_api.MessageStream) turns
kvrq stream events into that API's events; `job_stream` drives it and owns the job's fate: a stream
that does not reach its end (the client disconnected, the request timed out) cancels its job, which
frees the job's batch slot at the worker's next step.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, runtime_checkable

from redis.exceptions import RedisError
from starlette.responses import StreamingResponse

from producer.aio import AsyncJobHandle
from producer.errors import ResultTimeoutError
from producer.http.bridge import Bridge
from producer.http.errors import APIError, Flavor
from producer.models import GenerationResult, Usage
from producer.outcome import carried_usage
from producer.wire.protocol import StreamEvent

logger = logging.getLogger("kvrq.http")

#: OpenAI's last event.
DONE = b"data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
#: Seconds a stream with a keep-alive event waits for its first token before it opens and pings.
KEEPALIVE_S = 3.0


def data_event(payload: dict[str, Any]) -> bytes:
    """`data: {...}`: an OpenAI event."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


def named_event(payload: dict[str, Any]) -> bytes:
    """`event: <type>` and `data: {...}`: an Anthropic event, named by its `type`."""
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


#: What a route does with a job's result before answering (None: the job has none, canceled).
OnResult = Callable[[GenerationResult | None], Awaitable[None]]
#: Headers a stream learns when it opens (once its first event is there), e.g. the max_tokens clamp.
OpenHeaders = Callable[[], Awaitable[dict[str, str]]]


class Translator(Protocol):
    flavor: Flavor

    def head(self) -> list[bytes]:
        """Events sent before the job's first event."""
        ...

    def event(self, event: StreamEvent) -> list[bytes]:
        """Events for one job event (`end` included; never `start` or `error`)."""
        ...

    def tail(self, result: GenerationResult | None) -> list[bytes]:
        """Events after `end`, from the job's result (None when it has none: a canceled job)."""
        ...


@runtime_checkable
class UsageTail(Protocol):
    """A translator whose tail reads only the job's usage (OpenAI's usage chunk, Anthropic's message_delta):
    where the end event carries the usage (outcome.carried_usage) and no route reads the result
    (`on_result`), the stream closes from it, without reading the rq result."""

    def usage_tail(self, used: Usage | None) -> list[bytes]: ...


@runtime_checkable
class Pinging(Protocol):
    """A translator whose API has a keep-alive event (Anthropic's `ping`): its stream opens after
    KEEPALIVE_S without a first token and sends it every KEEPALIVE_S until one comes, so a client
    waiting through a long prefill sees the stream alive (Claude Code shows a stall banner otherwise)."""

    def ping(self) -> bytes: ...


async def open_stream(
    bridge: Bridge,
    handle: AsyncJobHandle,
    translator: Translator,
    *,
    timeout: float,
    gone: Awaitable[object],
    headers: dict[str, str] | None = None,
    on_result: OnResult | None = None,
    open_headers: OpenHeaders | None = None,
) -> StreamingResponse:
    """The job's event stream, opened once its first token (or its end) is there: a job that fails
    before it generates anything (invalid, too long for the context) is answered with its error's
    status instead, as a plain request's would be. Raises APIError, or ClientGone (job canceled).
    `on_result` is awaited with the job's result after its end event, before the translator's tail;
    `open_headers` when the stream opens, its headers added to the response's."""
    events = bridge.events(handle, timeout=timeout)
    first_event = asyncio.ensure_future(bridge.first(handle, events, timeout=timeout, gone=gone))
    pings = isinstance(translator, Pinging)
    try:
        await asyncio.wait({first_event}, timeout=KEEPALIVE_S if pings else None)
    except asyncio.CancelledError:
        first_event.cancel()
        raise
    if first_event.done():
        first = first_event.result()
        if first.kind == "error":
            raise await bridge.failure(handle, first)
        chunks = job_stream(
            bridge, handle, translator, _chain(first, events), timeout=timeout, on_result=on_result
        )
    else:  # a long wait for the first token: open now, and keep the client's stream alive
        chunks = _pinged(
            bridge, handle, translator, first_event, events, timeout=timeout, on_result=on_result
        )
    more = await open_headers() if open_headers is not None else {}
    return StreamingResponse(
        chunks, media_type="text/event-stream", headers={**HEADERS, **(headers or {}), **more}
    )


async def _pinged(
    bridge: Bridge,
    handle: AsyncJobHandle,
    translator: Translator,
    first_event: asyncio.Future[StreamEvent],
    events: AsyncIterator[StreamEvent],
    *,
    timeout: float,
    on_result: OnResult | None,
) -> AsyncIterator[bytes]:
    """The head and a ping every KEEPALIVE_S until the first event, then the job's stream (its head not
    repeated). An error before the first token ends the stream as the API's error event."""
    try:
        for chunk in translator.head():
            yield chunk
        while not first_event.done():
            assert isinstance(translator, Pinging)
            yield translator.ping()
            await asyncio.wait({first_event}, timeout=KEEPALIVE_S)
        first = first_event.result()
    except ResultTimeoutError:
        yield bridge.timed_out(handle, timeout).sse(translator.flavor)
        return
    except APIError as exc:
        yield exc.sse(translator.flavor)
        return
    except BaseException:  # the client left (ClientGone canceled the job) or the server stops
        first_event.cancel()
        bridge.cancel_soon(handle)
        raise
    if first.kind == "error":
        yield (await bridge.failure(handle, first)).sse(translator.flavor)
        return
    rest = job_stream(
        bridge, handle, translator, _chain(first, events), timeout=timeout, on_result=on_result, head=False
    )
    async for chunk in rest:
        yield chunk


async def _chain(first: StreamEvent, rest: AsyncIterator[StreamEvent]) -> AsyncIterator[StreamEvent]:
    yield first
    async for event in rest:
        yield event


async def job_stream(
    bridge: Bridge,
    handle: AsyncJobHandle,
    translator: Translator,
    events: AsyncIterator[StreamEvent],
    *,
    timeout: float,
    on_result: OnResult | None = None,
    head: bool = True,
) -> AsyncIterator[bytes]:
    ended = False
    try:
        for chunk in translator.head() if head else ():
            yield chunk
        async for event in events:
            if event.kind == "error":
                ended = True
                raise await bridge.failure(handle, event)
            for chunk in translator.event(event):
                yield chunk
            if event.kind == "end":
                ended = True
                for chunk in await _tail(bridge, handle, translator, event, on_result):
                    yield chunk
                return
    except ResultTimeoutError:
        yield bridge.timed_out(handle, timeout).sse(translator.flavor)
        ended = True  # timed_out canceled it
    except APIError as exc:
        logger.warning("job %s: %s", handle.id, exc.message)
        yield exc.sse(translator.flavor)
    except RedisError as exc:
        logger.warning("job %s: Redis: %s", handle.id, exc)
        yield APIError(503, f"Redis is unreachable: {exc}").sse(translator.flavor)
    finally:
        if not ended:
            bridge.cancel_soon(handle)


async def _tail(
    bridge: Bridge,
    handle: AsyncJobHandle,
    translator: Translator,
    end: StreamEvent,
    on_result: OnResult | None,
) -> list[bytes]:
    """The translator's events after the job's `end` event: from the usage the event carries where that is
    all they read (UsageTail), else from the job's rq result (an older worker's end event has no usage;
    the Responses API and a route's `on_result` read the whole result); a canceled job has none."""
    used = carried_usage(end)
    if used is not None and on_result is None and isinstance(translator, UsageTail):
        return translator.usage_tail(used)
    result = None if end.finish_reason == "canceled" else await bridge.result_after_end(handle)
    if on_result is not None:
        await on_result(result)
    return translator.tail(result)
