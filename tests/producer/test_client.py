"""Producer and JobHandle against fakeredis: enqueue format, idempotent ids, results, streams, cancel."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from pydantic import ValidationError
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer

from producer.client import (
    JobCanceledError,
    JobFailedError,
    JobNotFoundError,
    Producer,
    ResultTimeoutError,
)
from producer.models import GenerationRequest
from producer.wire.protocol import (
    ERROR_META_KEY,
    JOB_FUNCTION,
    ErrorCode,
    StreamEvent,
    agent_home_key,
    failure_of,
    last_line,
    stream_key,
    worker_alive_key,
    worker_queue_name,
)
from tests.producer.fakes import fail_like_rq, fake_redis, result_payload


@pytest.fixture
def sync_producer() -> Producer:
    return Producer(connection=fake_redis())


def _json_job(producer: Producer, job_id: str) -> Job:
    return Job.fetch(job_id, connection=producer.connection, serializer=JSONSerializer)


def test_submit_enqueues_a_json_rq_job(producer: Producer) -> None:
    handle = producer.submit(
        {"agent_id": "a1", "prompt": "hi", "max_tokens": 4, "retries": 2, "job_timeout": 30, "result_ttl": 60}
    )
    job = _json_job(producer, handle.id)
    assert job.func_name == JOB_FUNCTION
    payload = {"agent_id": "a1", "prompt": "hi", "max_tokens": 4, "temperature": 0.0, "top_p": 1.0}
    assert list(job.args) == [{**payload, "stop": [], "metadata": {}}]
    assert job.kwargs == {}
    assert (job.timeout, job.result_ttl, job.retries_left) == (30, 60, 2)
    assert job.meta == {"agent_id": "a1"}
    assert handle.status() == "queued"
    raw = producer.connection.hget(job.key, "data")
    assert b"pickle" not in raw and raw is not None  # JSON payload, zlib-compressed by rq


def test_invalid_requests_are_rejected_before_anything_is_enqueued(producer: Producer) -> None:
    with pytest.raises(ValidationError):
        producer.submit_many([{"prompt": "ok"}, {"prompt": "bad", "top_p": 2}])
    assert producer.queue().count == 0


def test_queue_options_pick_the_queue_and_the_front(producer: Producer) -> None:
    first = producer.submit({"prompt": "a"})
    urgent = producer.submit(GenerationRequest(prompt="b", at_front=True))
    other = producer.submit({"prompt": "c", "queue": "other"})
    assert producer.queue().get_job_ids() == [urgent.id, first.id]
    assert Queue("other", connection=producer.connection).get_job_ids() == [other.id]


def test_job_ids_make_resubmission_idempotent(producer: Producer) -> None:
    first = producer.submit({"prompt": "a"}, job_id="batch-1-line-7")
    again = producer.submit({"prompt": "a"}, job_id="batch-1-line-7")
    assert first.id == again.id == "batch-1-line-7"
    handles = producer.submit_many(
        [{"prompt": "a"}, {"prompt": "b"}], job_ids=["batch-1-line-7", "batch-1-line-8"]
    )
    assert [h.id for h in handles] == ["batch-1-line-7", "batch-1-line-8"]
    assert producer.queue().get_job_ids() == ["batch-1-line-7", "batch-1-line-8"]


def test_result_waits_for_the_worker_and_times_out(producer: Producer) -> None:
    handle = producer.submit({"prompt": "a"})
    with pytest.raises(ResultTimeoutError):
        handle.result(timeout=0.2)
    assert handle.status() == "queued"


def _finish_like_a_worker(producer: Producer, job_id: str, result: dict) -> None:  # type: ignore[type-arg]
    from worker.jobs.rqexec import KvrqWorker, finish_job, start_job

    worker = KvrqWorker(["kvrq"], connection=producer.connection)
    job, queue = Queue.dequeue_any(
        [producer.queue()], None, connection=producer.connection, serializer=JSONSerializer
    ) or (None, None)
    assert job is not None and job.id == job_id and queue is not None
    execution = start_job(worker, job, queue)
    finish_job(worker, job, queue, execution, result)


def test_result_returns_the_workers_result(producer: Producer) -> None:
    handle = producer.submit({"prompt": "a", "metadata": {"k": "v"}})
    payload = {
        "job_id": handle.id,
        "agent_id": None,
        "text": "Paris.",
        "token_ids": [1, 2],
        "finish_reason": "stop",
        "usage": {"prompt_tokens": 1, "reused_tokens": 0, "prefilled_tokens": 1, "generated_tokens": 2},
        "timings": {"queued_s": 0.0, "time_to_first_token_s": 0.1, "total_s": 0.2},
        "metadata": {"k": "v"},
    }
    finisher = threading.Timer(0.3, _finish_like_a_worker, args=(producer, handle.id, payload))
    finisher.start()
    started = time.monotonic()
    result = handle.result(timeout=5)
    assert result.text == "Paris." and result.metadata == {"k": "v"}
    assert time.monotonic() - started < 2
    finisher.join()


def test_a_result_written_just_after_the_status_read_wakes_the_wait_at_once(
    sync_producer: Producer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker finishes the job between result()'s status read and its wait: the wait must not take
    that result for an old one and sleep a whole poll (a 1 s tail kvrq serve's benchmark showed)."""
    producer = sync_producer
    handle = producer.submit({"prompt": "a"})
    payload = result_payload(handle.id)
    outcome = type(handle)._outcome
    reads = []

    def finished_right_after(self: object) -> object:
        found = outcome(handle)
        if not reads:
            _finish_like_a_worker(producer, handle.id, payload)  # just after the status was read
        reads.append(found)
        return found

    monkeypatch.setattr(type(handle), "_outcome", finished_right_after)
    started = time.monotonic()
    assert handle.result(timeout=5).text == "Paris."
    assert time.monotonic() - started < 0.5 and reads[0] is None


def test_canceling_a_queued_job(producer: Producer) -> None:
    handle = producer.submit({"prompt": "a"})
    assert handle.cancel() is True
    assert handle.status() == "canceled"
    assert producer.queue().count == 0
    with pytest.raises(JobCanceledError):
        handle.result(timeout=1)
    assert list(handle.stream(timeout=2)) == []  # a canceled job's stream ends quietly
    assert handle.cancel() is False


def test_missing_jobs(producer: Producer) -> None:
    with pytest.raises(JobNotFoundError):
        producer.handle("nope").status()


def test_stream_skips_text_already_yielded_when_a_job_runs_again(producer: Producer) -> None:
    handle = producer.submit({"prompt": "a"})
    key = stream_key(handle.id)
    events = [
        StreamEvent("start", attempt="1"),
        StreamEvent("delta", text="Hel", token=1),
        StreamEvent("delta", text="lo", token=2),
        StreamEvent("start", attempt="2"),  # the worker died; another one runs the job again
        StreamEvent("delta", text="He", token=1),
        StreamEvent("delta", text="llo", token=2),
        StreamEvent("delta", text=" world", token=3),
        StreamEvent("end", finish_reason="stop"),
    ]
    for event in events:
        producer.connection.xadd(key, event.to_fields())  # type: ignore[arg-type]
    assert list(handle.stream(timeout=2)) == ["Hel", "lo", " world"]


def test_stream_raises_the_workers_reason(producer: Producer) -> None:
    handle = producer.submit({"prompt": "a"})
    producer.connection.xadd(stream_key(handle.id), StreamEvent("delta", text="x", token=1).to_fields())  # type: ignore[arg-type]
    producer.connection.xadd(
        stream_key(handle.id), StreamEvent("error", error="RuntimeError: boom").to_fields()
    )  # type: ignore[arg-type]
    stream = handle.stream(timeout=2)
    assert next(stream) == "x"
    with pytest.raises(JobFailedError, match="boom"):
        next(stream)


def test_last_line_of_an_exc_string() -> None:
    assert last_line("Traceback (most recent call last):\n  File x\nValueError: bad\n") == "ValueError: bad"
    assert last_line(None) == "no reason recorded"


def test_a_failed_job_carries_the_code_the_worker_recorded(producer: Producer) -> None:
    handle = producer.submit({"prompt": "a"})
    error = {"code": ErrorCode.INVALID_REQUEST, "message": "prompt is empty"}
    fail_like_rq(producer.connection, handle.id, "Traceback ...\nJobRejected: prompt is empty", error)
    with pytest.raises(JobFailedError) as failed:
        handle.result(timeout=1)
    assert failed.value.code == ErrorCode.INVALID_REQUEST and failed.value.reason == "prompt is empty"
    assert "JobRejected" in failed.value.details  # rq's traceback stays available


def test_rq_abandoned_jobs_read_as_worker_crashed_others_as_internal(producer: Producer) -> None:
    abandoned, other = producer.submit({"prompt": "a"}), producer.submit({"prompt": "b"})
    rq_text = "Moved to FailedJobRegistry, due to AbandonedJobError, at x"
    fail_like_rq(producer.connection, abandoned.id, rq_text)
    fail_like_rq(producer.connection, other.id, "Traceback ...\nRuntimeError: boom")
    with pytest.raises(JobFailedError) as crashed:
        abandoned.result(timeout=1)
    assert crashed.value.code == ErrorCode.WORKER_CRASHED and "worker died" in crashed.value.reason
    with pytest.raises(JobFailedError) as unknown:
        other.result(timeout=1)
    assert unknown.value.code == ErrorCode.INTERNAL and unknown.value.reason == "RuntimeError: boom"


def test_the_kvrq_meta_wins_over_rq_text_and_a_malformed_meta_is_ignored() -> None:
    meta = {ERROR_META_KEY: {"code": ErrorCode.TIMEOUT, "message": "ran past 30 s"}}
    assert failure_of(meta, "AbandonedJobError") == (ErrorCode.TIMEOUT, "ran past 30 s")
    assert failure_of({ERROR_META_KEY: "oops"}, "ValueError: x") == (ErrorCode.INTERNAL, "ValueError: x")
    no_message = {ERROR_META_KEY: {"code": ErrorCode.ENGINE_ERROR}}
    assert failure_of(no_message, "E: y") == (ErrorCode.ENGINE_ERROR, "E: y")


def test_a_failed_stream_raises_with_the_jobs_code(producer: Producer) -> None:
    handle = producer.submit({"prompt": "a"})
    producer.connection.xadd(stream_key(handle.id), StreamEvent("error", error="kaboom").to_fields())  # type: ignore[arg-type]
    error = {"code": ErrorCode.ENGINE_ERROR, "message": "kaboom"}
    fail_like_rq(producer.connection, handle.id, "E: kaboom", error)
    with pytest.raises(JobFailedError) as failed:
        list(handle.stream(timeout=2))
    assert failed.value.code == ErrorCode.ENGINE_ERROR


def test_both_producers_write_the_same_redis_state_as_rq() -> None:
    """AsyncProducer enqueues through rq's own enqueue_call, recorded and sent on redis.asyncio: the
    job hash, queue entry and queue registration are rq's, field for field (times aside)."""
    import asyncio

    from tests.producer.clients import async_producer

    request = {"agent_id": "a1", "prompt": "hi", "max_tokens": 4, "retries": 2, "result_ttl": 60}
    blocking, other = fake_redis(), fake_redis()
    Producer(connection=blocking).submit(request, job_id="j1")
    Producer(connection=blocking).submit(request)
    producer = async_producer(other)
    asyncio.run(producer.submit(request, job_id="j1"))
    asyncio.run(producer.submit(request))

    def state(connection: Any) -> dict[str, Any]:
        fields = connection.hgetall(Job.key_for("j1"))
        for volatile in (b"created_at", b"enqueued_at"):
            assert fields.pop(volatile)
        queued = connection.lrange("rq:queue:kvrq", 0, -1)
        return {
            "job": fields,
            "queue": len(queued),
            "first": queued[0],
            "queues": connection.smembers("rq:queues"),
        }

    assert state(blocking) == state(other)
    job = Job.fetch("j1", connection=other, serializer=JSONSerializer)  # rq reads it as its own
    assert job.args[0]["prompt"] == "hi" and job.retries_left == 2 and job.meta == {"agent_id": "a1"}


def test_an_async_result_written_just_after_the_status_read_wakes_the_wait_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """test_a_result_written_just_after_the_status_read_wakes_the_wait_at_once, for AsyncJobHandle."""
    import asyncio

    from producer.aio import AsyncJobHandle
    from tests.producer.clients import async_producer

    blocking = fake_redis()
    producer = async_producer(blocking)
    sync = Producer(connection=blocking)
    payload = result_payload("")
    outcome = AsyncJobHandle._outcome
    reads: list[object] = []

    async def finished_right_after(self: AsyncJobHandle) -> object:
        found = await outcome(self)
        if not reads:
            _finish_like_a_worker(sync, self.id, {**payload, "job_id": self.id})
        reads.append(found)
        return found

    monkeypatch.setattr(AsyncJobHandle, "_outcome", finished_right_after)

    async def run() -> float:
        handle = await producer.submit({"prompt": "a"})
        started = time.monotonic()
        assert (await handle.result(timeout=5)).text == "Paris."
        return time.monotonic() - started

    assert asyncio.run(run()) < 0.5 and reads[0] is None


def test_an_agents_job_goes_to_its_live_homes_queue_else_the_shared_one(producer: Producer) -> None:
    """enqueue.placing's two reads (the agent's home, the home's heartbeat), sent by either client."""
    producer.connection.set(agent_home_key("A"), "w1")
    producer.connection.set(worker_alive_key("w1"), 1)
    homed = producer.submit({"agent_id": "A", "prompt": "x"})
    producer.connection.delete(worker_alive_key("w1"))
    orphaned = producer.submit({"agent_id": "A", "prompt": "x"})
    unplaced = Producer(connection=producer.connection, affinity=False).submit(
        {"agent_id": "A", "prompt": "x"}
    )
    origins = [_json_job(producer, handle.id).origin for handle in (homed, orphaned, unplaced)]
    assert origins == [worker_queue_name("kvrq", "w1"), "kvrq", "kvrq"]
