"""Saying what a long wait waits for (fakeredis): live workers of a queue, the notice clock, the details."""

from __future__ import annotations

import logging

import pytest
from redis import Redis
from rq import Worker

from producer import liveness
from producer.client import Producer, ResultTimeoutError
from producer.liveness import WorkerWatch, job_wait_detail, live_workers, unheard_queue
from tests.producer.fakes import fake_redis

NO_WORKER = "no live worker listens on queue 'kvrq'"


def start_worker(connection: Redis, queue: str = "kvrq", name: str = "w1") -> Worker:
    worker = Worker([queue], name=name, connection=connection, serializer="json")
    worker.register_birth()
    return worker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_live_workers_are_the_registered_ones_of_that_queue_whose_key_exists() -> None:
    connection = fake_redis()
    assert live_workers(connection, "kvrq") == []
    start_worker(connection, "kvrq", "w1")
    start_worker(connection, "other", "w2")
    dead = start_worker(connection, "kvrq", "w3")
    connection.delete(dead.key)  # its heartbeats stopped and rq's key expired
    assert [w.name for w in live_workers(connection, "kvrq")] == ["w1"]


def test_the_watch_says_it_after_the_first_wait_then_rarely() -> None:
    connection, clock, said = fake_redis(), Clock(), []
    watch = WorkerWatch(connection, "kvrq", said.append, first_s=5, repeat_s=30, clock=clock)
    clock.now += 4.9
    assert not watch.check()
    clock.now += 0.2
    assert watch.check() and said == [liveness.no_worker_line("kvrq")]
    assert NO_WORKER in said[0]
    clock.now += 29
    assert not watch.check()
    clock.now += 1.1
    assert watch.check() and len(said) == 2


def test_the_watch_is_quiet_while_a_worker_listens_or_jobs_progress() -> None:
    connection, clock, said = fake_redis(), Clock(), []
    watch = WorkerWatch(connection, "kvrq", said.append, first_s=5, repeat_s=30, clock=clock)
    clock.now += 4
    watch.progressed()  # a job ended: the clock starts again
    clock.now += 4
    assert not watch.check()
    worker = start_worker(connection)
    clock.now += 2
    assert not watch.check()  # a worker listens
    connection.delete(worker.key)
    clock.now += 5  # looked again soon after seeing the worker, not only after repeat_s
    assert watch.check() and len(said) == 1


def test_wait_details_say_where_a_job_stands() -> None:
    connection = fake_redis()
    producer = Producer(connection=connection)
    first, second, third = (producer.submit({"prompt": p}) for p in "abc")
    assert (
        job_wait_detail(connection, third.id)
        == f"job {third.id} is still queued: {liveness.no_worker_line('kvrq')}"
    )
    assert unheard_queue(connection, third.id) == "kvrq"
    start_worker(connection)
    assert job_wait_detail(connection, third.id) == (
        f"job {third.id} is still queued behind 2 job(s); 1 live worker(s) listen on queue 'kvrq'"
    )
    assert unheard_queue(connection, third.id) is None
    connection.hset(f"rq:job:{first.id}", mapping={"status": "started", "worker_name": "w1"})
    assert job_wait_detail(connection, first.id) == f"job {first.id} is running on worker w1"
    assert job_wait_detail(connection, "gone") == "job gone is no longer in Redis"


def test_result_timeout_says_no_worker_listens() -> None:
    handle = Producer(connection=fake_redis()).submit({"prompt": "a"})
    with pytest.raises(ResultTimeoutError, match=NO_WORKER) as timed_out:
        handle.result(timeout=0.2)
    assert str(timed_out.value).startswith(
        f"job {handle.id} did not end within 0.2 s: job {handle.id} is still"
    )


def test_result_logs_one_warning_while_it_waits_without_a_worker(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(liveness, "FIRST_NOTICE_S", 0.1)
    handle = Producer(connection=fake_redis()).submit({"prompt": "a"})
    with caplog.at_level(logging.WARNING, logger="kvrq.producer"), pytest.raises(ResultTimeoutError):
        handle.result(timeout=2.5)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"job {handle.id} waits: {liveness.no_worker_line('kvrq')}"]


def test_result_does_not_warn_while_a_worker_listens(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(liveness, "FIRST_NOTICE_S", 0.1)
    connection = fake_redis()
    start_worker(connection)
    handle = Producer(connection=connection).submit({"prompt": "a"})
    with (
        caplog.at_level(logging.WARNING, logger="kvrq.producer"),
        pytest.raises(ResultTimeoutError) as timed_out,
    ):
        handle.result(timeout=1.5)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "1 live worker(s) listen on queue 'kvrq'" in str(timed_out.value)
