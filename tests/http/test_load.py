"""`kvrq serve` under load, bounded and on loopback: 200 concurrent streaming clients (the official
`openai` client) send 1,000 requests to a real server process and Redis. A stand-in worker answers
each job with a text made of its own request, so a lost, hung, crossed or duplicated answer shows;
the server's memory must stay flat. The model is not the point here (tests/http/test_integration.py
runs the real one): the stand-in makes the run take seconds."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from rq.job import Job
from rq.serializers import JSONSerializer

from benchmarks import procs as shared
from benchmarks.procs import STAND_IN_MODEL, StandInWorker
from tests.http.test_integration import ServeProcess
from tests.worker.procs import RedisProcess, wait_for

pytestmark = [pytest.mark.integration]

MODEL = STAND_IN_MODEL
CLIENTS = 200
REQUESTS = 1000
WARMUP = 200
ROUND = 200


def stand_in_stack(workdir: Path) -> contextlib.AbstractContextManager[tuple[ServeProcess, StandInWorker]]:
    """benchmarks/procs.py's stack: a redis-server, the stand-in worker (this module's `StandInWorker`,
    which a test may patch) and a `kvrq serve` that lists its model."""
    return shared.stand_in_stack(workdir, redis=RedisProcess, stand_in=StandInWorker, serve=ServeProcess)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, StandInWorker]]:
    with stand_in_stack(tmp_path_factory.mktemp("http-load")) as running:
        yield running


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_200_streaming_clients_1000_requests(stack: tuple[ServeProcess, StandInWorker]) -> None:
    server, worker = stack
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)

    def ask(index: int) -> tuple[int, str, int]:
        words = f"request {index} from client {index % CLIENTS}"
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": words}],
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
            prompt_cache_key=f"load-{index % CLIENTS}",  # one agent per client: its requests run in order
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
        return index, text, usage.completion_tokens if usage else -1

    with ThreadPoolExecutor(CLIENTS) as pool:
        answers = list(pool.map(ask, range(WARMUP)))  # threads, connections and pools grow to their size
        rss = [rss_mb(server.proc.pid)]
        started = time.monotonic()
        for begin in range(WARMUP, REQUESTS, ROUND):
            answers += pool.map(ask, range(begin, begin + ROUND))
            rss.append(rss_mb(server.proc.pid))
        took = time.monotonic() - started
    assert [index for index, _, _ in answers] == list(range(REQUESTS))
    wrong = [(i, text) for i, text, _ in answers if text != f"request {i} from client {i % CLIENTS}"]
    assert wrong == [], wrong[:5]  # none lost, crossed or cut
    assert {tokens for _, _, tokens in answers} == {3}
    assert worker.jobs == REQUESTS  # none enqueued twice
    shown = " -> ".join(f"{mb:.0f}" for mb in rss)
    print(f"{REQUESTS - WARMUP} requests, {CLIENTS} clients: {took:.1f} s; server RSS by round {shown} MB")
    assert rss[-1] - rss[1] < 10, f"the server's memory grows round after round: {shown} MB"
    assert server.serves(MODEL)


def test_a_stopping_server_cancels_the_jobs_it_waits_on(tmp_path: Path) -> None:
    """SIGTERM while three requests wait: a plain and a streamed one on queued jobs, and a stream that
    has begun (its job's first delta sent, no end). All three jobs are canceled."""
    with stand_in_stack(tmp_path) as (server, worker):
        worker.pause()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)
        chunks: list[object] = []

        def streamed(words: str) -> None:
            for chunk in client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": words}], stream=True
            ):
                chunks.append(chunk)

        calls = [
            lambda: client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "plain"}]
            ),
            lambda: streamed("queued"),
            lambda: streamed("begun"),
        ]
        for call in calls:
            threading.Thread(target=_quietly, args=(call,), daemon=True).start()
        wait_for(lambda: worker.queue.count == 3, 10, "the jobs were not enqueued")
        jobs = worker.queue.get_job_ids()
        (begun,) = [
            j
            for j in jobs
            if Job.fetch(j, connection=worker.connection, serializer=JSONSerializer).args[0]["messages"][0][
                "content"
            ]
            == "begun"
        ]
        worker.connection.lrem(worker.queue.key, 1, begun)
        worker.begin(begun)
        wait_for(lambda: len(chunks) >= 2, 10, "the begun stream sent nothing")  # the role, then "be"
        server.stop()
        assert [Job(job_id, connection=worker.connection).get_status() for job_id in jobs] == ["canceled"] * 3


def _quietly(call: Callable[[], object]) -> None:
    with contextlib.suppress(openai.APIError):
        call()
