"""A real worker (builtin SmolLM2) and producers on a Sentinel-managed Redis, through `SENTINEL FAILOVER`.

One primary, one replica and three sentinels (redis-server binaries, loopback); the worker keeps its
queue and its agent caches there (`--store redis`), both through the `redis+sentinel://` URL. While a
producer enqueues a steady stream of jobs, the primary fails over: every enqueue that returned is on
the new primary and finishes, exactly once (one rq result, never a second run), the worker never exits,
and jobs enqueued after the switch run. These rounds run behind `-m chaos` (one, 20, and the round with
`kvrq serve` asking across the switch, an expected failure until its hang is found): the default suite's
failover round is tests/fleet/test_fleet_failover.py's, which checks all of this and more (two workers,
agents' turns, records, caches) at about the cost of one worker's round.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from redis import Redis
from rq.job import Job
from rq.results import Result
from rq.serializers import JSONSerializer

from producer.batch import run_batch
from producer.client import Producer
from producer.http.app import ServeSettings, create_app
from producer.wire.protocol import DEFAULT_QUEUE
from tests.fleet.sentinel import SentinelTopology, wait_until
from tests.worker.procs import WorkerProcess
from worker.cli import commands
from worker.cli.dashboard import make_app

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SYSTEM = "You are a concise assistant. Answer in one short sentence."
MODEL = "smollm2-135m"
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a color."}]
ENQUEUE_EVERY_S = 0.25
RESULT_TIMEOUT_S = 240


@pytest.fixture
def topology(tmp_path: Path) -> Iterator[SentinelTopology]:
    (tmp_path / "redis").mkdir()
    started = SentinelTopology(tmp_path / "redis").start()
    yield started
    started.stop()


@pytest.fixture
def worker(topology: SentinelTopology, tmp_path: Path) -> Iterator[WorkerProcess]:
    proc = WorkerProcess(
        topology.url, tmp_path, name="kvrq-sentinel", args=["--store", "redis", "--max-batch", "16"]
    )
    proc.start()
    yield proc
    proc.stop()


def request(index: int) -> dict[str, object]:
    question = f"Count from {index % 7} to {index % 7 + 3}."
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return {"agent_id": f"agent-{index % 5}", "messages": messages, "max_tokens": 4}


class Repeat:
    """Calls `action(index)` every `every` seconds from its own thread until the block ends; keeps when each
    call started and ended and what it returned, or what it raised."""

    def __init__(self, action: Callable[[int], object], every: float) -> None:
        self.action = action
        self.every = every
        self.done: list[tuple[float, float, object]] = []  # (started, ended, returned)
        self.raised: list[str] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        index = 0
        while not self.stopping.is_set():
            started = time.monotonic()
            try:
                returned = self.action(index)
                self.done.append((started, time.monotonic(), returned))
            except Exception as exc:  # an enqueue may raise: then it is not counted as acknowledged
                self.raised.append(f"{index}: {exc!r}")
            index += 1
            self.stopping.wait(self.every)

    def wait_for(self, calls: int, timeout: float, message: str) -> None:
        """Until `calls` calls returned; else fail with what was raised and where the thread is."""
        try:
            wait_until(lambda: len(self.done) >= calls, timeout, "")
        except AssertionError:
            stacks = [traceback.format_stack(frame) for frame in sys._current_frames().values()]
            where = "\n".join("".join(st[-20:]) for st in stacks if any("/producer/" in f for f in st))
            raise AssertionError(f"{message}; raised: {self.raised[-5:]}; now at:\n{where}") from None

    def results(self) -> list[object]:
        return [result for _, _, result in self.done]

    def __enter__(self) -> Repeat:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.thread.join(timeout=120)


def enqueue_stream(producer: Producer, prefix: str) -> Repeat:
    """Repeat that enqueues one job (id PREFIX-N) per call; returns the id once acknowledged."""

    def enqueue(index: int) -> str:
        producer.submit(request(index), job_id=f"{prefix}-{index}")
        return f"{prefix}-{index}"

    return Repeat(enqueue, ENQUEUE_EVERY_S)


def http_stream(client: TestClient) -> Repeat:
    """Repeat that asks kvrq serve for one chat completion per call; returns its status code."""

    def ask(index: int) -> int:
        answer = client.post(
            "/v1/chat/completions", json={"model": MODEL, "max_tokens": 4, "messages": MESSAGES}
        )
        if answer.status_code == 200:
            answer.json()["choices"][0]["message"]["content"]  # noqa: B018  (a completion, or it raises)
        return answer.status_code

    return Repeat(ask, 0.5)


def finished_once(connection: Redis, job_ids: list[str]) -> dict[str, str]:
    """job id -> what is wrong with it, for the jobs that did not finish with exactly one result."""
    serializer = JSONSerializer()
    wrong = {}
    for job_id in job_ids:
        status = connection.hget(Job.key_for(job_id), "status")
        if status != b"finished":
            wrong[job_id] = f"status {status!r}"
            continue
        results = Result.all(Job(job_id, connection=connection), serializer=serializer)
        if len(results) != 1 or results[0].type != Result.Type.SUCCESSFUL:
            wrong[job_id] = f"{len(results)} results: {[r.type for r in results]}"
    return wrong


def failover_round(topology: SentinelTopology, worker: WorkerProcess, round_no: int, *, http: bool) -> None:
    """One SENTINEL FAILOVER under a stream of enqueues (and, with `http`, of kvrq serve requests)."""
    before = topology.primary_port()
    # `with`: one event loop serves every request, as uvicorn's does; a bare TestClient runs each
    # request on a loop of its own, which the app's asyncio Redis connections may not cross.
    with (
        TestClient(create_app(ServeSettings(redis_url=topology.url))) as client,
        Producer(topology.url) as producer,
        enqueue_stream(producer, f"r{round_no}") as stream,
        http_stream(client) if http else contextlib.nullcontext() as asking,
    ):
        wait_until(lambda: len(stream.done) >= 4, 60, "no enqueue acknowledged before the failover")
        failing_over = time.monotonic()
        new = topology.failover()
        failed_over = time.monotonic()
        assert new != before
        switched = len(stream.done)
        stream.wait_for(switched + 4, 60, "no enqueue acknowledged after the switch")
        if asking is not None:
            asking.wait_for(2, 120, "kvrq serve did not answer twice")
    assert not worker.exited(), worker.log()[-4000:]
    acknowledged = [str(job_id) for job_id in stream.results()]
    after_switch = acknowledged[switched:]
    assert after_switch, "nothing was enqueued after the switch"
    primary = topology.data(new)
    missing = [job_id for job_id in acknowledged if not primary.exists(Job.key_for(job_id))]
    assert missing == [], f"acknowledged enqueues not on the new primary: {missing}"

    def all_ended() -> bool:
        statuses = [primary.hget(Job.key_for(job_id), "status") for job_id in acknowledged]
        return all(s in (b"finished", b"failed") for s in statuses)

    wait_until(all_ended, RESULT_TIMEOUT_S, "acknowledged jobs did not all end", interval=0.5)
    assert finished_once(primary, acknowledged) == {}
    assert not worker.exited(), worker.log()[-4000:]
    print(
        f"round {round_no}: {len(acknowledged)} acknowledged ({len(after_switch)} after the switch), "
        f"{len(stream.raised)} raised: {stream.raised[:3]}"
    )
    if asking is None:
        return
    # kvrq serve rode it too: every request it got during the round was answered with a completion.
    assert asking.raised == [] and set(asking.results()) == {200}, (asking.results(), asking.raised)
    spanning = [1 for started, ended, _ in asking.done if started < failed_over and ended > failing_over]
    assert spanning, "kvrq serve had no request in flight while the primary failed over"
    print(f"round {round_no}: {len(asking.done)} HTTP requests answered")


def test_every_entry_point_takes_the_sentinel_url(
    topology: SentinelTopology, worker: WorkerProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Producer, kvrq serve, a batch run, kvrq status and the dashboard, against one real worker."""
    with Producer(topology.url) as producer:
        handle = producer.submit(request(0))
        # The Sentinel URL's default wait=1: submit returned once the replica held the job too.
        replica = next(port for port in topology.data_ports if port != topology.primary_port())
        assert topology.data(replica).exists(Job.key_for(handle.id))
        result = handle.result(timeout=RESULT_TIMEOUT_S)
    assert result.text and result.usage.generated_tokens > 0
    primary = topology.data(topology.primary_port())
    assert primary.keys("kvrq:cache:*"), "the worker's Redis store wrote nothing through the Sentinel URL"

    http = TestClient(create_app(ServeSettings(redis_url=topology.url)))
    answer = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 4, "messages": MESSAGES})
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"]

    line = {"custom_id": "one", "method": "POST", "url": "/v1/chat/completions"}
    (tmp_path / "in.jsonl").write_text(json.dumps({**line, "body": {"messages": MESSAGES, "max_tokens": 4}}))
    summary = run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", redis_url=topology.url, progress=False)
    assert (summary.state, summary.done) == ("done", 1)

    out = io.StringIO()
    assert commands.status(topology.url, None, out) == 0
    assert "kvrq-sentinel" in out.getvalue()

    import rq.serializers  # make_app makes JSON rq's default serializer process-wide (its own process's)

    monkeypatch.setattr(rq.serializers, "PickleSerializer", rq.serializers.PickleSerializer)
    dashboard = make_app(topology.url).test_client()
    rows = dashboard.get("/0/data/workers.json").get_json()["workers"]
    assert [row["name"] for row in rows] == ["kvrq-sentinel"]
    assert primary.llen(f"rq:queue:{DEFAULT_QUEUE}") == 0


@pytest.mark.chaos
def test_a_failover_loses_no_acknowledged_enqueue_and_runs_each_job_once(
    topology: SentinelTopology, worker: WorkerProcess
) -> None:
    failover_round(topology, worker, 0, http=False)


@pytest.mark.chaos
def test_kvrq_serve_rides_a_failover(topology: SentinelTopology, worker: WorkerProcess) -> None:
    failover_round(topology, worker, 0, http=True)


@pytest.mark.chaos
@pytest.mark.timeout(2400)  # 20 rounds of ~20-45 s each, past the suite's 600 s per test
def test_twenty_failovers(topology: SentinelTopology, worker: WorkerProcess) -> None:
    for round_no in range(20):
        started = time.monotonic()
        failover_round(topology, worker, round_no, http=False)
        print(f"round {round_no}: {time.monotonic() - started:.1f} s")
