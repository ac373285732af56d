"""A real `kvrq worker` through outages and bad input: Redis gone for seconds, a full disk under its
store, fuzzed payloads from plain rq. The worker stays up and every good job is delivered once.

Default run: an 8 s Redis outage, 40 fuzzed payloads, a 1 MB tmpfs store. `-m chaos`: a 30 s
outage and 1,000 fuzzed payloads.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from producer.client import JobHandle, Producer
from tests.conftest import in_ci
from tests.worker.chaos_checks import ENDED, deliveries, summary
from tests.worker.fuzz_jobs import enqueue, failure_problem, fuzz_cases
from tests.worker.procs import RedisProcess, WorkerProcess, module_redis, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STORY = "Once upon a time, in a small village by the sea,"
QUESTION = [{"role": "user", "content": "Describe the sea in a few words."}]


redis_proc = module_redis("outages", persistent=True)


@pytest.fixture(scope="module")
def worker_proc(
    redis_proc: RedisProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    worker = WorkerProcess(redis_proc.url, tmp_path_factory.mktemp("worker-outages"), name="kvrq-outages")
    worker.start()
    yield worker
    worker.stop()


@pytest.fixture
def producer(redis_proc: RedisProcess, worker_proc: WorkerProcess) -> Iterator[Producer]:
    with Producer(redis_proc.url) as p:
        yield p


def wait_all_ended(handles: list[JobHandle], timeout: float = 240) -> None:
    wait_for(lambda: all(h.status() in ENDED for h in handles), timeout, "some jobs never ended")


@pytest.mark.parametrize("outage_s", [8, pytest.param(30, marks=pytest.mark.chaos)])
def test_redis_unreachable_for_seconds_the_worker_waits_and_resumes(
    producer: Producer, redis_proc: RedisProcess, worker_proc: WorkerProcess, outage_s: int
) -> None:
    handles = producer.submit_many(
        [{"prompt": STORY, "max_tokens": 40} for _ in range(3)]
        + [{"agent_id": f"outage-{outage_s}", "messages": QUESTION, "max_tokens": 16}]
    )
    for seen, _ in enumerate(handles[0].events(timeout=120)):
        if seen >= 3:
            break
    redis_proc.stop()
    time.sleep(outage_s)
    assert not worker_proc.exited(), worker_proc.log()[-3000:]
    redis_proc.start()
    wait_all_ended(handles, timeout=outage_s + 180)
    delivered = deliveries(handles)
    assert all(d.finished_once for d in delivered), delivered
    # The worker waited: it ran each job once. (A job it had taken itself for dead would run twice.)
    assert [d.attempts for d in delivered] == [1] * len(handles), delivered
    assert "Redis unreachable" in worker_proc.log()
    assert producer.submit({"prompt": "Still there?", "max_tokens": 3}).result(timeout=60).text


@pytest.mark.parametrize("count", [40, pytest.param(1000, marks=pytest.mark.chaos)])
def test_fuzzed_payloads_fail_alone_and_the_worker_stays_up(
    producer: Producer, worker_proc: WorkerProcess, count: int
) -> None:
    cases = fuzz_cases(count, seed=count)
    handles = [producer.handle(enqueue(case, producer.connection).id) for case in cases]
    wait_all_ended(handles, timeout=60 + count * 0.5)
    problems = [
        f"{case.describe()}: {problem}"
        for case, handle in zip(cases, handles, strict=True)
        if (problem := failure_problem(case, handle))
    ]
    assert problems == []
    assert not worker_proc.exited()
    good = producer.submit({"messages": QUESTION, "max_tokens": 6}).result(timeout=120)
    assert good.usage.generated_tokens > 0


# ---- a full disk under the store ---------------------------------------------------------------


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MB tmpfs: one SmolLM2 cache of ~25 tokens fills it (46 KB per token)."""
    mount_point = tmp_path / "tiny-disk"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        message = f"cannot mount a tmpfs (needs root): {mounted.stderr.strip()}"
        if in_ci():
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_a_full_disk_under_the_store_costs_no_answer(
    full_disk: Path, redis_proc: RedisProcess, tmp_path: Path
) -> None:
    worker = WorkerProcess(
        redis_proc.url,
        tmp_path,
        name="kvrq-full-disk",
        queue="full-disk",
        args=["--store", f"disk:{full_disk}"],
    )
    worker.start()
    try:
        with Producer(redis_proc.url, queue="full-disk", affinity=False) as producer:
            turns = producer.submit_many(
                [{"agent_id": f"disk-{n}", "messages": QUESTION, "max_tokens": 24 + n} for n in range(4)]
            )
            wait_all_ended(turns)
            delivered = deliveries(turns)
            assert summary(delivered)["finished"] == len(turns), delivered
            assert all(d.finished_once for d in delivered), delivered
            wait_for(lambda: "was not saved" in worker.log(), 30, "the failed put was not logged")
            assert "No space left on device" in worker.log()
            assert not worker.exited()
            again = producer.submit({"agent_id": "disk-0", "messages": QUESTION, "max_tokens": 4})
            assert again.result(timeout=120).usage.generated_tokens > 0
    finally:
        worker.stop()
