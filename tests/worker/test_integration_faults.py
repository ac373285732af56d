"""Real `kvrq worker` processes under stress: a tiny KV pool, SIGTERM drain, kill -9 recovery on the
operator's word (`kvrq maintenance --dead-worker`; the workers' own crash check: test_integration_crash.py).

Each test starts its own redis-server and worker(s) (builtin SmolLM2, OpenBLAS).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from rq import Queue
from rq.serializers import JSONSerializer

from producer.client import JobFailedError, JobHandle, Producer
from tests.worker.procs import ROOT, RedisProcess, WorkerProcess, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ENDED = ("finished", "failed", "canceled")


@pytest.fixture
def workers() -> Iterator[list[WorkerProcess]]:
    started: list[WorkerProcess] = []
    yield started
    for worker in started:
        worker.stop()


def statuses(handles: list[JobHandle]) -> list[str]:
    return [h.status() for h in handles]


def story(max_tokens: int, **extra: object) -> dict[str, object]:
    return {"prompt": "Once upon a time, in a small village by the sea,", "max_tokens": max_tokens, **extra}


def test_tiny_pool_keeps_jobs_queued_and_fails_only_what_can_never_fit(
    redis_proc: RedisProcess, producer: Producer, workers: list[WorkerProcess], tmp_path: Path
) -> None:
    # 2 blocks of 256 tokens: two of these jobs (13 + 40 tokens, one block each) run at once.
    worker = WorkerProcess(
        redis_proc.url, tmp_path, name="kvrq-tiny", args=["--pool-blocks", "2", "--max-batch", "8"]
    )
    workers.append(worker.start())
    handles = producer.submit_many([story(40) for _ in range(5)])
    never_fits = producer.submit(story(600))  # 3 blocks: more than the whole pool
    seen_queued = False
    while not all(s in ENDED for s in statuses(handles)):
        now = statuses(handles)
        assert now.count("failed") == 0
        seen_queued |= now.count("queued") >= 2  # the pool is full: later jobs wait in the queue
        time.sleep(0.05)
    assert seen_queued
    results = [h.result(timeout=5) for h in handles]
    in_engine = []  # (admitted, ended): the span each job held KV blocks
    for handle, result in zip(handles, results, strict=True):
        enqueued = handle.job().enqueued_at
        assert enqueued is not None
        in_engine.append(
            (enqueued.timestamp() + result.timings.queued_s, enqueued.timestamp() + result.timings.total_s)
        )
    for start, _ in in_engine:
        assert sum(1 for s, e in in_engine if s <= start < e) <= 2  # never more running than the pool holds
    assert all(r.usage.generated_tokens > 0 for r in results)
    with pytest.raises(JobFailedError, match="RequestTooLargeError"):
        never_fits.result(timeout=30)


def test_sigterm_finishes_what_it_can_hands_back_the_rest_and_exits_0(
    redis_proc: RedisProcess, producer: Producer, workers: list[WorkerProcess], tmp_path: Path
) -> None:
    worker = WorkerProcess(redis_proc.url, tmp_path, name="kvrq-drain", env={"KVRQ_DRAIN_TIMEOUT": "2"})
    workers.append(worker.start())
    short = producer.submit({"prompt": "Hello", "max_tokens": 6})
    long = producer.submit(story(80, agent_id="drain-a"))
    waiting = producer.submit(story(4, agent_id="drain-a"))  # same agent: held until `long` is done
    next(e for e in long.events(timeout=60) if e.kind == "delta")  # generating
    assert waiting.status() == "started"  # held by the worker, waiting for its agent
    assert worker.terminate(timeout=60) == 0, worker.log()
    assert short.status() == "finished"
    assert statuses([long, waiting]) == ["queued", "queued"]  # handed back, in order
    queue = Queue("kvrq", connection=producer.connection, serializer=JSONSerializer)
    assert queue.get_job_ids() == [long.id, waiting.id]
    assert queue.started_job_registry.get_job_count() == 0
    assert not producer.connection.sismember("rq:workers", "rq:worker:kvrq-drain")
    # The next worker runs them; the handed-back job streams again from its start.
    workers.append(WorkerProcess(redis_proc.url, tmp_path, name="kvrq-drain-2").start())
    result = long.result(timeout=180)
    assert waiting.result(timeout=60).usage.reused_tokens > 0
    assert "".join(long.stream(timeout=5)) == result.text


def test_kill_9_loses_no_job(
    redis_proc: RedisProcess, producer: Producer, workers: list[WorkerProcess], tmp_path: Path
) -> None:
    # Default liveness (10 s): within this test only the operator's word re-runs the jobs.
    first = WorkerProcess(redis_proc.url, tmp_path, name="kvrq-doomed-1")
    workers.append(first.start())
    retried = producer.submit(story(60, retries=2))
    plain = producer.submit(story(60))  # no retries: a crash re-run does not need them
    wait_for(lambda: statuses([retried, plain]) == ["started"] * 2, 60, "jobs did not start")
    next(e for e in plain.events(timeout=60) if e.kind == "delta")  # generating when killed
    first.kill()
    # On demand: the operator names the dead worker; nothing waits for its liveness key to expire.
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "worker.cli",
            "maintenance",
            "--redis",
            redis_proc.url,
            "--dead-worker",
            "kvrq-doomed-1",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=True,
    )
    assert "worker kvrq-doomed-1: declared dead" in done.stdout, done.stdout + done.stderr
    assert "queue kvrq: 2 job(s) of dead workers re-queued" in done.stdout, done.stdout + done.stderr
    assert statuses([retried, plain]) == ["queued", "queued"]  # re-run, not failed
    queue = Queue("kvrq", connection=producer.connection, serializer=JSONSerializer)
    assert set(queue.get_job_ids()) == {retried.id, plain.id}
    assert queue.started_job_registry.get_job_count() == 0
    assert retried.job().retries_left == 2  # a crash re-run spends the crash budget, not retries
    assert not producer.connection.sismember("rq:workers", "rq:worker:kvrq-doomed-1")

    workers.append(WorkerProcess(redis_proc.url, tmp_path, name="kvrq-rescuer").start())
    for handle in (retried, plain):
        result = handle.result(timeout=180)
        assert "".join(handle.stream(timeout=5)) == result.text  # the re-run's text, shown once
        events = list(handle.events(timeout=5))
        assert [e.kind for e in events].count("start") == 2 and events[-1].kind == "end"
        assert len(handle.job().results()) == 1
    assert queue.count == 0 and queue.started_job_registry.get_job_count() == 0
