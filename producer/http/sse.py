"""Server-sent events: a job's stream events translated into one API's event stream.

A translator (openai_api.ChatStream, openai_api.CompletionStream, anthropic_api.MessageStream) turns
kvrq stream events into that API's events; `job_stream` drives it and owns the job's fate: a stream
that does not reach its end (the client disconnected, the request timed out) cancels its job, which
frees the job's batch slot at the worker's next step.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from redis.exceptions import RedisError
from starlette.responses import StreamingResponse

from producer.client import JobHandle, ResultTimeoutError
from producer.http.bridge import Bridge
from producer.http.errors import APIError, Flavor
from producer.models import GenerationResult
from producer.protocol import StreamEvent

logger = logging.getLogger("kvrq.http")

#: OpenAI's last event.
DONE = b"data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def data_event(payload: dict[str, Any]) -> bytes:
    """`data: {...}`: an OpenAI event."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


def named_event(payload: dict[str, Any]) -> bytes:
    """`event: <type>` and `data: {...}`: an Anthropic event, named by its `type`."""
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


#: What a route does with a job's result before answering (None: the job has none, canceled).
OnResult = Callable[[GenerationResult | None], Awaitable[None]]


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


async def open_stream(
    bridge: Bridge,
    handle: JobHandle,
    translator: Translator,
    *,
    timeout: float,
    gone: Awaitable[object],
    headers: dict[str, str] | None = None,
    on_result: OnResult | None = None,
) -> StreamingResponse:
    """The job's event stream, opened once its first token (or its end) is there: a job that fails
    before it generates anything (invalid, too long for the context) is answered with its error's
    status instead, as a plain request's would be. Raises APIError, or ClientGone (job canceled).
    `on_result` is awaited with the job's result after its end event, before the translator's tail."""
    events = bridge.events(handle, timeout=timeout)
    first = await bridge.first(handle, events, timeout=timeout, gone=gone)
    if first.kind == "error":
        raise await bridge.failure(handle, first.error or "failed")
    return StreamingResponse(
        job_stream(bridge, handle, translator, _chain(first, events), timeout=timeout, on_result=on_result),
        media_type="text/event-stream",
        headers={**HEADERS, **(headers or {})},
    )


async def _chain(first: StreamEvent, rest: AsyncIterator[StreamEvent]) -> AsyncIterator[StreamEvent]:
    yield first
    async for event in rest:
        yield event


async def job_stream(
    bridge: Bridge,
    handle: JobHandle,
    translator: Translator,
    events: AsyncIterator[StreamEvent],
    *,
    timeout: float,
    on_result: OnResult | None = None,
) -> AsyncIterator[bytes]:
    ended = False
    try:
        for chunk in translator.head():
            yield chunk
        async for event in events:
            if event.kind == "error":
                ended = True
                raise await bridge.failure(handle, event.error or "failed")
            for chunk in translator.event(event):
                yield chunk
            if event.kind == "end":
                ended = True
                result = None if event.finish_reason == "canceled" else await bridge.result_after_end(handle)
                if on_result is not None:
                    await on_result(result)
                for chunk in translator.tail(result):
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
