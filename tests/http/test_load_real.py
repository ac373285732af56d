"""`kvrq serve` under load with the real worker behind it (builtin SmolLM2, two tokens an answer):
200 concurrent streaming clients, none lost, hung or answered twice, the server's memory flat.

The default suite sends one round of 200 requests (~1.5 min here); `-m chaos` sends the issue's 1,000
in five rounds and holds the server's memory flat from the second round on. The stand-in worker of
test_load.py covers the same contract, memory included, in seconds; this one shows the whole path
holds it with real batching, prefix reuse and result writes."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from redis import Redis
from rq import Queue
from rq.serializers import JSONSerializer

from tests.http.test_integration import MODEL, ServeProcess
from tests.http.test_load import rss_mb
from tests.worker.procs import RedisProcess, WorkerProcess, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CLIENTS = 200


@pytest.fixture(scope="module")
def real_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, RedisProcess]]:
    workdir = tmp_path_factory.mktemp("http-load-real")
    redis = RedisProcess(workdir)
    redis.start()
    worker = WorkerProcess(redis.url, workdir, name="load-worker", args=["--max-batch", "32"])
    server = ServeProcess(redis.url, workdir)
    try:
        worker.start()
        wait_for(
            lambda: server.serves(MODEL) or server.proc.poll() is not None, 60, "kvrq serve did not start"
        )
        yield server, redis
    finally:
        server.stop()
        worker.stop()
        redis.stop()


def load(server: ServeProcess, redis: RedisProcess, requests: int) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)

    def ask(index: int) -> tuple[int, str, str, int]:
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Say the number {index}."}],
            max_tokens=2,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
        return index, chunks[0].id, text, usage.completion_tokens if usage else -1

    queue = Queue("kvrq", connection=Redis.from_url(redis.url), serializer=JSONSerializer)
    finished_before = queue.finished_job_registry.get_job_count()
    answers: list[tuple[int, str, str, int]] = []
    rss: list[float] = []
    started = time.monotonic()
    with ThreadPoolExecutor(CLIENTS) as pool:
        for begin in range(0, requests, CLIENTS):
            answers += pool.map(ask, range(begin, min(begin + CLIENTS, requests)))
            rss.append(rss_mb(server.proc.pid))
    took = time.monotonic() - started
    assert [index for index, _, _, _ in answers] == list(range(requests))  # none lost, none hung
    assert len({chat_id for _, chat_id, _, _ in answers}) == requests  # one job each
    assert {tokens for _, _, _, tokens in answers} <= {1, 2} and all(text for _, _, text, _ in answers)
    finished = queue.finished_job_registry.get_job_count() - finished_before
    assert finished == requests  # none enqueued twice, none failed
    assert queue.failed_job_registry.get_job_count() == 0
    shown = " -> ".join(f"{mb:.0f}" for mb in rss)
    print(
        f"{requests} requests, {CLIENTS} clients, real worker: {took:.1f} s; server RSS by round {shown} MB"
    )
    assert rss[-1] - rss[0] < 10, f"the server's memory grows round after round: {shown} MB"


def test_200_streaming_clients_on_the_real_worker(real_stack: tuple[ServeProcess, RedisProcess]) -> None:
    load(*real_stack, requests=CLIENTS)


@pytest.mark.chaos
def test_200_streaming_clients_1000_requests_on_the_real_worker(
    real_stack: tuple[ServeProcess, RedisProcess],
) -> None:
    load(*real_stack, requests=1000)
