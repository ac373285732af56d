"""AsyncProducer against a real redis-server and `kvrq worker` on the builtin model: its jobs are rq's
(a worker takes them, rq's Job.fetch reads them), its waits give what the blocking client's give, and
cancel stops a running job."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from rq.job import Job
from rq.serializers import JSONSerializer

from producer.aio import AsyncProducer
from producer.client import Producer
from producer.wire.protocol import JOB_FUNCTION
from tests.worker.procs import RedisProcess, WorkerProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = RedisProcess(tmp_path_factory.mktemp("redis-aio"))
    server.start()
    worker = WorkerProcess(server.url, tmp_path_factory.mktemp("worker-aio"), name="kvrq-aio")
    try:
        worker.start()
        yield server.url
    finally:
        worker.stop()
        server.stop()


def test_a_worker_takes_an_async_job_and_rq_reads_it(redis_url: str) -> None:
    request = {"messages": QUESTION, "max_tokens": 8, "agent_id": "aio-alice", "metadata": {"k": "v"}}

    async def run() -> tuple[str, list[str], str, str]:
        async with AsyncProducer(redis_url) as producer:
            handle = await producer.submit(request)
            streamed = [text async for text in handle.stream(timeout=120)]
            result = await handle.result(timeout=30)
            return handle.id, streamed, result.text, await handle.status()

    job_id, streamed, text, status = asyncio.run(run())
    assert "".join(streamed) == text and text and status == "finished"
    with Producer(redis_url) as sync:
        job = Job.fetch(job_id, connection=sync.connection, serializer=JSONSerializer)
        assert job.func_name == JOB_FUNCTION and job.meta.get("agent_id") == "aio-alice"
        assert job.args[0]["metadata"] == {"k": "v"}
        # The blocking client reads the async client's job alike, and the same greedy request
        # enqueued by it gets the same answer.
        assert sync.handle(job_id).result(timeout=5).text == text
        again = sync.submit({**request, "agent_id": "aio-bob"}).result(timeout=120)
        assert again.text == text


def test_an_async_cancel_stops_a_running_job(redis_url: str) -> None:
    async def run() -> tuple[str, str | None]:
        async with AsyncProducer(redis_url) as producer:
            handle = await producer.submit({"prompt": "Once upon a time", "max_tokens": 400})
            events = handle.events(timeout=120)
            for _ in range(3):
                await anext(events)
            await events.aclose()
            assert await handle.status() == "started"
            assert await handle.cancel() is True
            for _ in range(300):
                if await handle.status() == "canceled":
                    break
                await asyncio.sleep(0.1)
            last = [event async for event in handle.events(timeout=5)][-1]
            return await handle.status(), last.finish_reason

    assert asyncio.run(run()) == ("canceled", "canceled")
