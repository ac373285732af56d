"""rq's documented behaviours, side by side: a real kvrq worker (builtin model, few tokens) and a
plain `rq worker --with-scheduler` (JSON serializer, a plain Python function) on one Redis.

Each scenario runs on both sides and compares what an rq user observes: statuses, registries,
TTLs, timeouts, retries, scheduled jobs, callbacks, dependencies. Where kvrq differs on purpose
the test says so (docs/worker.md, "Where kvrq differs from rq"). One worker process per side for
the whole module; the last test starts a second kvrq worker to see the scheduler lock handed on.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from redis import Redis
from rq import Callback, Queue, Retry
from rq.command import send_stop_job_command
from rq.job import Dependency, Job
from rq.registry import (
    CanceledJobRegistry,
    DeferredJobRegistry,
    FailedJobRegistry,
    FinishedJobRegistry,
    ScheduledJobRegistry,
    StartedJobRegistry,
)
from rq.scheduler import RQScheduler

from producer.wire.protocol import JOB_FUNCTION
from tests.worker.procs import ROOT, RedisProcess, WorkerProcess, module_redis, wait_for
from tests.worker.rq_functions import calls_key

pytestmark = [pytest.mark.integration, pytest.mark.slow]

KVRQ_QUEUE, PLAIN_QUEUE = "conf-kvrq", "conf-rq"
KVRQ_WORKER, PLAIN_WORKER = "conf-kvrq-1", "conf-rq-1"
FUNCTIONS = "tests.worker.rq_functions"
MAX_BATCH = 2  # a kvrq worker dequeues while its engine has free slots; a plain rq worker holds one job


redis_proc = module_redis("conformance")


@pytest.fixture(scope="module")
def kvrq_worker(
    redis_proc: RedisProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    worker = WorkerProcess(
        redis_proc.url,
        tmp_path_factory.mktemp("kvrq-conformance"),
        name=KVRQ_WORKER,
        queue=KVRQ_QUEUE,
        args=["--max-batch", str(MAX_BATCH)],
        env={"KVRQ_AFFINITY": "false", "KVRQ_PROGRESS_INTERVAL": "5"},
    )
    worker.start()
    yield worker
    if not worker.exited():
        assert worker.terminate() == 0, worker.log()


@pytest.fixture(scope="module")
def plain_worker(
    redis_proc: RedisProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[subprocess.Popen[bytes]]:
    log_path = tmp_path_factory.mktemp("rq-conformance") / "rq.log"
    rq_cli = Path(sys.executable).parent / "rq"
    command = [str(rq_cli), "worker", PLAIN_QUEUE, "--url", redis_proc.url, "--serializer", "json"]
    command += ["--with-scheduler", "--name", PLAIN_WORKER, "--path", str(ROOT)]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    connection = Redis.from_url(redis_proc.url)
    wait_for(
        lambda: connection.sismember("rq:workers", f"rq:worker:{PLAIN_WORKER}"), 30, "rq worker did not start"
    )
    yield proc
    proc.terminate()
    proc.wait(timeout=30)


@dataclass(frozen=True)
class Side:
    """One worker kind: its queue, and a quick or a slow job (one that runs until stopped or timed out)."""

    kind: str  # "kvrq" or "rq"
    queue: Queue
    capacity: int  # jobs it holds at once

    @property
    def connection(self) -> Redis:
        return self.queue.connection

    def call(self, slow: bool = False) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
        if self.kind == "kvrq":
            payload = {"prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 1000 if slow else 3}
            return JOB_FUNCTION, (payload,), {}
        return f"{FUNCTIONS}.work", (), {"seconds": 120 if slow else 0.05}

    def enqueue(self, slow: bool = False, **options: Any) -> Job:
        func, args, kwargs = self.call(slow)
        return self.queue.enqueue(func, *args, **kwargs, **options)

    def enqueue_in(self, delay: timedelta, slow: bool = False, **options: Any) -> Job:
        func, args, kwargs = self.call(slow)
        return self.queue.enqueue_in(delay, func, *args, **kwargs, **options)

    def prepare(self, slow: bool = False, **options: Any) -> Any:
        func, args, kwargs = self.call(slow)
        return Queue.prepare_data(func, args=args, kwargs=kwargs, **options)

    def registries(self, job: Job) -> list[str]:
        """Which of rq's registries (`rq info`, rq-dashboard) list the job."""
        name, connection = self.queue.name, self.connection
        found = []
        for label, registry in (
            ("started", StartedJobRegistry(name, connection=connection)),
            ("finished", FinishedJobRegistry(name, connection=connection)),
            ("failed", FailedJobRegistry(name, connection=connection)),
            ("canceled", CanceledJobRegistry(name, connection=connection)),
            ("scheduled", ScheduledJobRegistry(name, connection=connection)),
            ("deferred", DeferredJobRegistry(name, connection=connection)),
        ):
            if job.id in registry.get_job_ids(cleanup=False) if label == "started" else job.id in registry:
                found.append(label)
        if job.id in self.queue.job_ids:
            found.append("queue")
        return found


@pytest.fixture
def sides(
    kvrq_worker: WorkerProcess, plain_worker: subprocess.Popen[bytes], redis_proc: RedisProcess
) -> list[Side]:
    connection = Redis.from_url(redis_proc.url)
    return [
        Side("kvrq", Queue(KVRQ_QUEUE, connection=connection, serializer="json"), MAX_BATCH),
        Side("rq", Queue(PLAIN_QUEUE, connection=connection, serializer="json"), 1),
    ]


def both(sides: list[Side], scenario: Callable[[Side], Any]) -> None:
    """Run `scenario` on both sides and compare what it observed."""
    observed = {side.kind: scenario(side) for side in sides}
    assert observed["kvrq"] == observed["rq"], observed


def status(job: Job) -> str | None:
    raw: bytes | None = job.connection.hget(job.key, "status")  # type: ignore[assignment]
    return raw.decode() if raw is not None else None


def started_at(side: Side, job: Job) -> datetime:
    started = Job.fetch(job.id, connection=side.connection, serializer="json").started_at
    assert started is not None
    return started


def trace(job: Job, until: set[str], timeout: float = 60) -> list[str]:
    """The job's statuses, polled every 20 ms, repeats dropped, up to one in `until`."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        current = status(job) or "gone"
        if not seen or seen[-1] != current:
            seen.append(current)
        if current in until:
            return seen
        time.sleep(0.02)
    raise AssertionError(f"job {job.id} never reached {until}: {seen}")


def wait_status(job: Job, wanted: str, timeout: float = 60) -> None:
    wait_for(lambda: status(job) == wanted, timeout, f"job {job.id} never {wanted} (is {status(job)})", 0.02)


def calls(job: Job) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in job.connection.lrange(calls_key(job.id), 0, -1)]


def callback(name: str, timeout: int | None = None) -> Callback:
    return Callback(f"{FUNCTIONS}.{name}", timeout=timeout)


# ---- statuses, registries, TTLs, timeouts ----------------------------------------------------------


def test_status_transitions_and_registries(sides: list[Side]) -> None:
    def scenario(side: Side) -> Any:
        job = side.enqueue(slow=True, job_timeout=30)
        wait_status(job, "started")
        while_started = side.registries(job)
        send_stop_job_command(side.connection, job.id, serializer="json")
        stopped = trace(job, {"stopped", "failed", "finished", "canceled"})
        quick = side.enqueue()
        seen = trace(quick, {"finished", "failed"})
        return {
            "while started": while_started,
            "stop-job": stopped[-1],
            "after stop": side.registries(job),
            "quick": [s for s in seen if s != "queued"],  # a worker may take it before the first poll
            "quick registries": side.registries(quick),
            "result": type(
                quick.fetch(quick.id, connection=side.connection, serializer="json").return_value()
            ).__name__,
        }

    both(sides, scenario)


def test_result_ttl_failure_ttl_and_ttl(sides: list[Side]) -> None:
    def scenario(side: Side) -> Any:
        kept_1s = side.enqueue(result_ttl=1)
        discarded = side.enqueue(result_ttl=0)
        failed = side.enqueue(slow=True, job_timeout=1, failure_ttl=2)
        expires_waiting = side.enqueue_in(timedelta(seconds=2), ttl=1)
        wait_for(lambda: status(kept_1s) in (None, "finished"), 60, "result_ttl job did not end")
        wait_for(lambda: status(discarded) in (None, "finished"), 60, "result_ttl=0 job did not end")
        wait_status(failed, "failed")
        right_after = {
            "result_ttl=1": Job.exists(kept_1s.id, side.connection),
            "failure_ttl=2": Job.exists(failed.id, side.connection),
        }
        time.sleep(3.5)
        return {
            "right after": right_after,
            "result_ttl=0 kept": Job.exists(discarded.id, side.connection),
            "result_ttl=1 after 3.5 s": Job.exists(kept_1s.id, side.connection),
            "failure_ttl=2 after 3.5 s": Job.exists(failed.id, side.connection),
            "ttl=1, waited 2 s": Job.exists(expires_waiting.id, side.connection),
        }

    both(sides, scenario)


def test_job_timeout_fails_the_job_with_rqs_timeout_exception(sides: list[Side]) -> None:
    def scenario(side: Side) -> Any:
        job = side.enqueue(slow=True, job_timeout=1, on_failure=callback("on_failure"))
        started = time.monotonic()
        wait_status(job, "failed")
        job = Job.fetch(job.id, connection=side.connection, serializer="json")
        return {
            "within 1-15 s": 0.5 < time.monotonic() - started < 15,
            "exc": "JobTimeoutException" in (job.latest_result().exc_string or ""),  # type: ignore[union-attr]
            "callbacks": calls(job),
            "registries": side.registries(job),
        }

    both(sides, scenario)


# ---- at_front, stop, cancel, dependencies on a busy worker -----------------------------------------


def test_at_front_cancel_and_dependents_of_a_canceled_parent(sides: list[Side]) -> None:
    """With the worker full: C (at_front) runs before A and B; a canceled queued parent keeps its
    dependents deferred, even those that allow a failure (rq: a canceled dependency is never met)."""

    def scenario(side: Side) -> Any:
        blockers = [side.enqueue(slow=True, job_timeout=60) for _ in range(side.capacity)]
        for blocker in blockers:
            wait_status(blocker, "started")
        a, b = side.enqueue(), side.enqueue()
        c = side.enqueue(at_front=True)
        parent = side.enqueue()
        child = side.enqueue(depends_on=Dependency(jobs=[parent], allow_failure=True))
        order = [a.id, b.id, c.id]
        queued = [order.index(i) if i in order else i for i in side.queue.job_ids if i in order]
        parent.cancel()
        for blocker in blockers:
            send_stop_job_command(side.connection, blocker.id, serializer="json")
        for job in (a, b, c):
            wait_status(job, "finished")
        started = sorted((a, b, c), key=lambda j: started_at(side, j))
        time.sleep(1)
        return {
            "queue order": queued,
            "started order": [order.index(j.id) for j in started][:1],  # kvrq starts the rest together
            "parent": (status(parent), side.registries(parent)),
            "child": (status(child), side.registries(child)),
        }

    both(sides, scenario)


# ---- retries and scheduled jobs -------------------------------------------------------------------


def test_retry_without_and_with_interval(sides: list[Side]) -> None:
    def scenario(side: Side) -> Any:
        at_once = side.enqueue(
            slow=True, job_timeout=1, retry=Retry(max=1), on_failure=callback("on_failure")
        )
        later = side.enqueue(
            slow=True, job_timeout=1, retry=Retry(max=1, interval=3), on_failure=callback("on_failure")
        )
        seen = trace(later, {"failed"}, timeout=90)
        wait_status(at_once, "failed", timeout=90)
        fetched = Job.fetch(later.id, connection=side.connection, serializer="json")
        return {
            "at once": (
                [c["exc_type"] for c in calls(at_once)],
                Job.fetch(at_once.id, connection=side.connection, serializer="json").retries_left,
            ),
            "interval: scheduled between runs": "scheduled" in seen and seen[-1] == "failed",
            "interval: failures": [c["exc_type"] for c in calls(later)],
            "retries_left": fetched.retries_left,
        }

    both(sides, scenario)


def test_enqueue_in_and_enqueue_at_run_on_time(sides: list[Side]) -> None:
    def scenario(side: Side) -> Any:
        enqueued = datetime.now(timezone.utc)
        job_in = side.enqueue_in(timedelta(seconds=2))
        func, args, kwargs = side.call()
        job_at = side.queue.enqueue_at(enqueued + timedelta(seconds=3), func, *args, **kwargs)
        scheduled = (status(job_in), status(job_at), side.registries(job_in))
        wait_status(job_in, "finished", timeout=30)
        wait_status(job_at, "finished", timeout=30)
        delays = [(started_at(side, j) - enqueued).total_seconds() for j in (job_in, job_at)]
        # rq's ScheduledJobRegistry keeps whole seconds: a job may start up to 1 s early, in rq too
        return {"scheduled": scheduled, "on time": [1 <= delays[0] < 6, 2 <= delays[1] < 7]}

    both(sides, scenario)


# ---- callbacks -------------------------------------------------------------------------------------


def test_success_and_stopped_callbacks_get_rqs_arguments(sides: list[Side]) -> None:
    def scenario(side: Side) -> Any:
        ok = side.enqueue(on_success=callback("on_success"), on_failure=callback("on_failure"))
        stopped = side.enqueue(slow=True, job_timeout=60, on_stopped=callback("on_stopped"))
        wait_status(stopped, "started")
        send_stop_job_command(side.connection, stopped.id, serializer="json")
        wait_status(ok, "finished")
        wait_status(stopped, "stopped")
        return {"success": calls(ok), "stopped": calls(stopped)}

    both(sides, scenario)


def test_a_callback_that_raises_or_hangs_is_logged_and_changes_nothing_else(
    sides: list[Side], kvrq_worker: WorkerProcess
) -> None:
    kvrq = sides[0]
    raising = kvrq.enqueue(on_success=callback("raising"))
    hanging = kvrq.enqueue(slow=True, job_timeout=1, on_failure=callback("sleeping", timeout=1))
    wait_status(raising, "finished")  # rq would fail it: the answer is good, kvrq keeps it
    started = time.monotonic()
    wait_status(hanging, "failed")
    assert time.monotonic() - started < 20
    hanging = Job.fetch(hanging.id, connection=kvrq.connection, serializer="json")
    assert "JobTimeoutException" in (hanging.latest_result().exc_string or "")  # type: ignore[union-attr]
    assert [c["kind"] for c in calls(raising)] == ["raising"]
    assert [c["kind"] for c in calls(hanging)] == ["sleeping"]
    log = kvrq_worker.log()
    assert f"job {raising.id}: its on_success callback failed" in log
    assert f"job {hanging.id}: its on_failure callback failed" in log
    assert "RuntimeError: a callback that raises" in log
    after = kvrq.enqueue()
    wait_status(after, "finished")  # the worker goes on
    # the plain rq worker, for the record: its raising on_success fails the job
    plain = sides[1].enqueue(on_success=callback("raising"))
    wait_status(plain, "failed")


# ---- dependencies, enqueue_many ----------------------------------------------------------------------


def test_dependents_run_as_rq_decides(sides: list[Side]) -> None:
    def scenario(side: Side) -> Any:
        parent = side.enqueue()
        child = side.enqueue(depends_on=parent)
        failing = side.enqueue(slow=True, job_timeout=1)
        tolerant = side.enqueue(depends_on=Dependency(jobs=[failing], allow_failure=True))
        strict = side.enqueue(depends_on=failing)
        deferred = (status(child) in ("deferred", "finished"), status(tolerant), status(strict))
        wait_status(child, "finished")
        wait_status(failing, "failed")
        wait_status(tolerant, "finished")
        time.sleep(1)
        return {"deferred first": deferred, "strict after failure": (status(strict), side.registries(strict))}

    both(sides, scenario)


def test_enqueue_many(sides: list[Side]) -> None:
    def scenario(side: Side) -> Any:
        jobs = side.queue.enqueue_many(
            [side.prepare(), side.prepare(result_ttl=60), side.prepare(at_front=True)]
        )
        for job in jobs:
            wait_status(job, "finished")
        return [side.registries(job) for job in jobs]

    both(sides, scenario)


def test_kvrq_cancel_of_a_running_parent_keeps_its_dependents_deferred(sides: list[Side]) -> None:
    kvrq = sides[0]
    parent = kvrq.enqueue(slow=True, job_timeout=60, on_stopped=callback("on_stopped"))
    child = kvrq.enqueue(depends_on=Dependency(jobs=[parent], allow_failure=True))
    wait_status(parent, "started")
    parent.cancel()  # rq's own cancel of a started job: the worker stops it at its next heartbeat
    wait_for(lambda: kvrq.registries(parent) == ["canceled"], 30, "the running parent was not let go")
    time.sleep(1)
    assert status(parent) == "canceled"
    assert (status(child), kvrq.registries(child)) == ("deferred", ["deferred"])
    assert calls(parent) == []  # a cancel is not a stop: no on_stopped


def test_rq_info_lists_both_workers_and_queues(sides: list[Side], redis_proc: RedisProcess) -> None:
    info = subprocess.run(
        [str(Path(sys.executable).parent / "rq"), "info", "--url", redis_proc.url, "--serializer", "json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert info.returncode == 0, info.stderr
    for name in (KVRQ_QUEUE, PLAIN_QUEUE, KVRQ_WORKER, PLAIN_WORKER):
        assert name in info.stdout


# ---- the scheduler lock across a fleet (last: it stops the module's kvrq worker) -------------------


def test_a_stopping_worker_hands_the_scheduler_lock_on(
    sides: list[Side], kvrq_worker: WorkerProcess, redis_proc: RedisProcess, tmp_path: Path
) -> None:
    kvrq = sides[0]
    lock = RQScheduler.get_locking_key(KVRQ_QUEUE)
    assert kvrq.connection.get(lock) == KVRQ_WORKER.encode(), "the first worker holds the queue's lock"
    second = WorkerProcess(
        redis_proc.url, tmp_path, name="conf-kvrq-2", queue=KVRQ_QUEUE, args=["--max-batch", "1"]
    )
    second.start()
    try:
        time.sleep(2)
        assert kvrq.connection.get(lock) == KVRQ_WORKER.encode(), "one scheduler per queue across the fleet"
        assert kvrq_worker.terminate() == 0
        wait_for(lambda: kvrq.connection.get(lock) == b"conf-kvrq-2", 10, "no worker took the lock over")
        job = kvrq.enqueue_in(timedelta(seconds=1))
        wait_status(job, "finished", timeout=30)
        assert Job.fetch(job.id, connection=kvrq.connection, serializer="json").worker_name == "conf-kvrq-2"
    finally:
        assert second.terminate() == 0, second.log()
    assert kvrq.connection.get(lock) is None, "a stopped worker releases its scheduler lock"
