"""Both producers behind one blocking face, so a test written for Producer runs on AsyncProducer too.

`AsyncView` drives an AsyncProducer from a test's plain code: each call runs to its end on one event
loop; `connection` is the blocking fakeredis client over the same server (what the tests' helpers
write with), `queue()` rq's Queue over it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import fakeredis
from rq import Queue

from producer.aio import AsyncJobHandle, AsyncProducer
from producer.wire.protocol import SERIALIZER, StreamEvent


class HandleView:
    """An AsyncJobHandle with JobHandle's blocking methods."""

    def __init__(self, runner: asyncio.Runner, handle: AsyncJobHandle) -> None:
        self.runner = runner
        self.handle = handle
        self.id = handle.id

    def status(self) -> str:
        return self.runner.run(self.handle.status())

    def meta(self) -> dict[str, Any]:
        return self.runner.run(self.handle.meta())

    def result(self, timeout: float | None = None, **options: Any) -> Any:
        return self.runner.run(self.handle.result(timeout, **options))

    def cancel(self) -> bool:
        return self.runner.run(self.handle.cancel())

    def stream(self, timeout: float | None = None) -> Iterator[str]:
        return self._iterate(self.handle.stream(timeout))

    def events(self, timeout: float | None = None) -> Iterator[StreamEvent]:
        return self._iterate(self.handle.events(timeout))

    def _iterate(self, items: Any) -> Iterator[Any]:
        while True:
            try:
                yield self.runner.run(anext(items))
            except StopAsyncIteration:
                return


class AsyncView:
    """An AsyncProducer with Producer's blocking methods."""

    def __init__(self, runner: asyncio.Runner, producer: AsyncProducer) -> None:
        self.runner = runner
        self.producer = producer
        assert producer.blocking is not None
        self.connection = producer.blocking
        self.tenant = producer.tenant

    def submit(self, request: Any, **options: Any) -> HandleView:
        return HandleView(self.runner, self.runner.run(self.producer.submit(request, **options)))

    def submit_many(self, requests: Any, **options: Any) -> list[HandleView]:
        handles = self.runner.run(self.producer.submit_many(requests, **options))
        return [HandleView(self.runner, handle) for handle in handles]

    def handle(self, job_id: str) -> HandleView:
        return HandleView(self.runner, self.producer.handle(job_id))

    def queue(self, name: str | None = None) -> Queue:
        return Queue(name or self.producer.queue_name, connection=self.connection, serializer=SERIALIZER)

    def conversation(self, agent_id: str) -> Any:
        return self.runner.run(self.producer.conversation(agent_id))


def async_producer(blocking: fakeredis.FakeRedis, **options: Any) -> AsyncProducer:
    """An AsyncProducer over the fakeredis server `blocking` uses."""
    server = blocking.connection_pool.connection_kwargs["server"]
    return AsyncProducer(connection=fakeredis.FakeAsyncRedis(server=server), blocking=blocking, **options)
