"""rq's contract kept by the worker's own parts, without a model: rq's scheduler run by the loop
(worker/jobs/scheduled_jobs.py), stop-job vs cancel, callbacks (one that raises changes nothing else), and
dependents of a job failed past its crash budget or re-run after a crash. The same behaviours end
to end, beside a plain `rq worker`: test_rq_conformance.py."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone

import pytest
from redis import Redis
from rq import Callback, Queue, Retry
from rq.job import Dependency, Job, JobStatus
from rq.registry import FailedJobRegistry, ScheduledJobRegistry
from rq.scheduler import RQScheduler

from producer.wire.protocol import (
    CAPACITY_FIELD,
    CRASH_BUDGET_META_KEY,
    JOB_FUNCTION,
    cancel_key,
    worker_alive_key,
    worker_queue_name,
)
from tests.worker.fakes import FakeEngine
from tests.worker.harness import Harness
from tests.worker.procs import RedisProcess
from tests.worker.rq_functions import calls_key
from worker.fleet.maintenance import rerun_crashed
from worker.jobs import rqexec
from worker.jobs.scheduled_jobs import ScheduledJobs

FUNCTIONS = "tests.worker.rq_functions"
PAYLOAD = {"prompt": "x", "max_tokens": 1000}


@pytest.fixture
def connection(redis_proc: RedisProcess) -> Iterator[Redis]:
    yield Redis.from_url(redis_proc.url)


def calls(connection: Redis, job_id: str) -> list[dict[str, str]]:
    return [json.loads(raw) for raw in connection.lrange(calls_key(job_id), 0, -1)]


@pytest.mark.integration
def test_one_worker_holds_a_queues_scheduler_lock_and_moves_due_jobs(connection: Redis) -> None:
    first = ScheduledJobs(connection, ["q"], "w1", interval=1)
    second = ScheduledJobs(connection, ["q"], "w2", interval=1)
    first.run()
    second.run()
    assert (first.locked_queues, second.locked_queues) == ({"q"}, set())
    queue = Queue("q", connection=connection, serializer="json")
    due = queue.enqueue_at(datetime.now(timezone.utc) - timedelta(seconds=1), JOB_FUNCTION, PAYLOAD)
    later = queue.enqueue_in(timedelta(hours=1), JOB_FUNCTION, PAYLOAD)
    second.run()  # no lock: moves nothing
    assert due.get_status() == JobStatus.SCHEDULED
    first.run()
    assert (due.get_status(), later.get_status()) == (JobStatus.QUEUED, JobStatus.SCHEDULED)
    assert queue.job_ids == [due.id]
    first.stop()  # a stopping worker hands the lock on: the other takes it at its next run
    assert connection.get(RQScheduler.get_locking_key("q")) is None
    second.run()
    assert second.locked_queues == {"q"}
    assert first.due(time.monotonic() + 1.5) and not ScheduledJobs(connection, ["q"], "w3", interval=0).due(
        1e12
    )  # 0: off
    second.stop()


@pytest.mark.integration
def test_a_retry_with_an_interval_is_scheduled_on_the_shared_queue(connection: Redis) -> None:
    """A job taken from a worker's own queue retries on the shared one, which every worker schedules."""
    worker = rqexec.KvrqWorker(["q"], connection=connection, name="w1", affinity=True)
    worker.register_birth()
    own = Queue(worker_queue_name("q", "w1"), connection=connection, serializer="json")
    job = own.enqueue(
        JOB_FUNCTION, PAYLOAD, retry=Retry(max=1, interval=30), on_failure=Callback(f"{FUNCTIONS}.on_failure")
    )
    dequeued, queue = Queue.dequeue_any([own], None, connection=connection, serializer="json")  # type: ignore[misc]
    execution = rqexec.start_job(worker, dequeued, queue)
    rqexec.fail_job(
        worker, dequeued, queue, execution, "JobTimeoutException: too slow", retry=True, code="timeout"
    )
    assert job.get_status() == JobStatus.SCHEDULED
    assert job.id in ScheduledJobRegistry("q", connection=connection, serializer="json")
    assert job.id not in ScheduledJobRegistry(own.name, connection=connection, serializer="json")
    assert calls(connection, job.id) == [
        {"kind": "failure", "status": "failed", "exc_type": "JobTimeoutException"}
    ]


@pytest.mark.integration
def test_a_dead_workers_jobs_and_their_dependents(connection: Redis) -> None:
    """Past its crash budget a job fails with its on_failure callback (rq's AbandonedJobError) and its
    failure-tolerant dependents run; a job re-run after the crash has not ended: its dependents wait."""
    queue = Queue("q", connection=connection, serializer="json")
    parent = queue.enqueue(
        JOB_FUNCTION, PAYLOAD, meta={CRASH_BUDGET_META_KEY: 0}, on_failure=Callback(f"{FUNCTIONS}.on_failure")
    )
    tolerant = queue.enqueue(JOB_FUNCTION, PAYLOAD, depends_on=Dependency(jobs=[parent], allow_failure=True))
    strict = queue.enqueue(JOB_FUNCTION, PAYLOAD, depends_on=parent)
    dead = rqexec.KvrqWorker(["q"], connection=connection, name="dead-worker")
    dead.register_birth()
    connection.hset(dead.key, CAPACITY_FIELD, 1)  # a kvrq worker, whose liveness key is gone
    rerun = queue.enqueue(JOB_FUNCTION, PAYLOAD)  # a crash budget left: re-run, not ended
    waiting = queue.enqueue(JOB_FUNCTION, PAYLOAD, depends_on=Dependency(jobs=[rerun], allow_failure=True))
    for _ in range(2):
        dequeued, _ = Queue.dequeue_any([queue], None, connection=connection, serializer="json")  # type: ignore[misc]
        rqexec.start_job(dead, dequeued, queue)
    report = rerun_crashed(connection, ["q"])
    assert report.crashed == {"q": [parent.id]} and report.rerun == {"q": [rerun.id]}
    assert (rerun.get_status(), waiting.get_status()) == (JobStatus.QUEUED, JobStatus.DEFERRED)
    assert parent.get_status() == JobStatus.FAILED
    assert calls(connection, parent.id) == [
        {"kind": "failure", "status": "started", "exc_type": "AbandonedJobError"}
    ]
    assert (tolerant.get_status(), strict.get_status()) == (JobStatus.QUEUED, JobStatus.DEFERRED)


def test_dependents_of_a_parent_rerun_after_a_crash_run_once_the_rerun_finishes() -> None:
    """Worker loops on one Redis: the parent's worker dies mid-job, another re-runs the parent, and only
    when that re-run finishes do its dependents (one strict, one failure-tolerant) run, once each."""
    h = Harness()
    queue = Queue("kvrq", connection=h.redis, serializer="json")
    parent = queue.enqueue(JOB_FUNCTION, {"prompt": "x", "max_tokens": 40})
    strict = queue.enqueue(JOB_FUNCTION, {"prompt": "y", "max_tokens": 2}, depends_on=parent)
    tolerant = queue.enqueue(
        JOB_FUNCTION,
        {"prompt": "z", "max_tokens": 2},
        depends_on=Dependency(jobs=[parent], allow_failure=True),
    )
    h.run_until(lambda: parent.get_status() == JobStatus.STARTED)
    dead = h.loop.worker.name
    h.redis.delete(worker_alive_key(dead))  # the worker is gone; nothing drives its loop any more
    h.loop = h.new_loop(FakeEngine())
    h.run_until(lambda: parent.get_meta().get("kvrq_crashes") == 1)  # the survivor's crash check
    assert (strict.get_status(), tolerant.get_status()) == (JobStatus.DEFERRED, JobStatus.DEFERRED)
    h.run_until(lambda: parent.get_status() == JobStatus.FINISHED)
    assert h.producer.handle(parent.id).result(timeout=1).worker == h.loop.worker.name != dead
    h.run_until(lambda: h.statuses([h.producer.handle(j.id) for j in (strict, tolerant)]) == ["finished"] * 2)
    for job in (parent, strict, tolerant):
        assert len(Job.fetch(job.id, connection=h.redis, serializer="json").results()) == 1  # ran once


def test_rqs_stop_command_stops_a_job_and_runs_its_stopped_callback() -> None:
    h = Harness()
    stopped = h.producer.submit({"prompt": "x", "max_tokens": 1000})
    canceled = h.producer.submit({"prompt": "y", "max_tokens": 1000})
    for handle in (stopped, canceled):
        h.redis.hset(handle.job().key, "stopped_callback_name", f"{FUNCTIONS}.on_stopped")
    h.run_until(lambda: h.statuses([stopped, canceled]) == ["started", "started"])
    h.loop.worker.commands.put({"command": "stop-job", "job_id": stopped.id})  # `rq`, dashboards
    h.redis.set(cancel_key(canceled.id), 1)  # JobHandle.cancel: its flag, then the same command
    h.loop.worker.commands.put({"command": "stop-job", "job_id": canceled.id})
    h.run_until(lambda: h.statuses([stopped, canceled]) == ["stopped", "canceled"])
    assert stopped.id in FailedJobRegistry("kvrq", connection=h.redis, serializer="json")
    assert [c["kind"] for c in calls(h.redis, stopped.id)] == ["stopped"]
    assert calls(h.redis, canceled.id) == []  # a cancel is not a stop (rq runs no callback on cancel)
    assert h.loop.counts["stopped"] == 1 and h.loop.counts["canceled"] == 1


def test_a_success_callback_that_raises_leaves_the_job_finished(caplog: pytest.LogCaptureFixture) -> None:
    h = Harness()
    handle = h.producer.submit({"prompt": "x", "max_tokens": 2})
    h.redis.hset(handle.job().key, "success_callback_name", f"{FUNCTIONS}.raising")
    h.run_until(lambda: handle.status() == "finished")
    assert Job.fetch(handle.id, connection=h.redis, serializer="json").return_value() is not None
    assert f"job {handle.id}: its on_success callback failed" in caplog.text
    assert [c["kind"] for c in calls(h.redis, handle.id)] == ["raising"]


def test_a_stopped_callback_that_raises_is_logged_and_changes_nothing_else(
    caplog: pytest.LogCaptureFixture,
) -> None:
    h = Harness()
    handle = h.producer.submit({"prompt": "x", "max_tokens": 1000})
    h.redis.hset(handle.job().key, "stopped_callback_name", f"{FUNCTIONS}.raising")
    h.run_until(lambda: handle.status() == "started")
    h.loop.worker.commands.put({"command": "stop-job", "job_id": handle.id})
    h.run_until(lambda: handle.status() == "stopped")
    assert [c["kind"] for c in calls(h.redis, handle.id)] == ["raising"]  # it ran, and raised
    assert f"job {handle.id}: its on_stopped callback failed" in caplog.text
    # the same ending as with a callback that returns: stopped, in the FailedJobRegistry, not retried
    assert handle.id in FailedJobRegistry("kvrq", connection=h.redis, serializer="json")
    assert h.loop.counts["stopped"] == 1 and h.loop.counts["failed"] == 0
    assert not h.loop.scheduler.all() and h.engine.pool.free_blocks == h.engine.pool.total_blocks
