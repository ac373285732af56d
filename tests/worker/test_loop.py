"""The worker loop against fakeredis and a fake engine: rq bookkeeping, streams, ordering, faults."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from rq import Queue
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from producer.client import JobCanceledError, JobFailedError
from producer.wire.protocol import ERROR_META_KEY, JOB_FUNCTION, agent_lock_key
from tests.worker.fakes import FakeEngine
from tests.worker.harness import Harness, stored_events
from worker.fleet.confirmed_endings import Lost
from worker.fleet.maintenance import clean_queues
from worker.jobs import rqexec
from worker.loop.held import HeldJob
from worker.loop.outcomes import Outcome


@pytest.fixture
def h() -> Iterator[Harness]:
    harness = Harness()
    yield harness


def test_jobs_run_and_return_results(h: Harness) -> None:
    handles = [
        h.producer.submit({"prompt": f"p{i}", "max_tokens": 3 + i, "metadata": {"i": i}}) for i in range(3)
    ]
    h.run_until(h.all_ended(handles))
    for i, handle in enumerate(handles):
        result = handle.result(timeout=1)
        assert result.text == "abcdef"[: 3 + i]
        assert result.finish_reason == "length"
        assert result.metadata == {"i": i}
        assert result.usage.prompt_tokens == 2
        assert result.usage.generated_tokens == 3 + i
        assert result.timings.total_s >= result.timings.queued_s >= 0
        assert result.worker == h.loop.worker.name
        job = handle.job()
        assert job.get_status() == JobStatus.FINISHED
        assert job.get_meta()["progress"]["phase"] == "finished"
    assert h.engine.max_active == 3  # all three ran in one batch
    queue = Queue("kvrq", connection=h.redis, serializer=JSONSerializer)
    assert queue.finished_job_registry.get_job_count() == 3
    assert queue.started_job_registry.get_job_count() == 0


def test_stream_has_every_delta_in_order_then_end(h: Harness) -> None:
    handle = h.producer.submit({"prompt": "x", "max_tokens": 5})
    h.run_until(h.all_ended([handle]))
    events = list(handle.events(timeout=1))
    assert [e.kind for e in events] == ["start", "delta", "delta", "delta", "delta", "delta", "end"]
    assert "".join(e.text for e in events) == "abcde" == "".join(handle.stream(timeout=1))
    assert events[-1].finish_reason == "length"
    assert h.redis.ttl(f"kvrq:stream:{handle.id}") > 0


def test_a_jobs_ending_is_one_event_that_carries_its_usage_or_its_error_code(h: Harness) -> None:
    """Issue 41: a stream reader needs no rq result for a job's usage or its failure's code; the fields
    are additions (an older reader reads `finish_reason` / `error` as before)."""
    done = h.producer.submit({"prompt": "x", "max_tokens": 3})
    bad = h.producer.submit({"prompt": "x", "max_tokens": 5000})
    h.run_until(h.all_ended([done, bad]))
    end = list(done.events(timeout=1))[-1]
    assert end.kind == "end" and end.finish_reason == "length"
    assert end.data == {"usage": done.result(timeout=1).usage.model_dump()}
    error = list(bad.events(timeout=1))[-1]
    assert error.kind == "error" and error.code == "context_length_exceeded"
    assert error.code == bad.meta()[ERROR_META_KEY]["code"]


def test_plain_rq_enqueue_gets_the_same_treatment(h: Harness) -> None:
    queue = Queue("kvrq", connection=h.redis, serializer=JSONSerializer)
    positional = queue.enqueue(JOB_FUNCTION, {"prompt": "hi", "max_tokens": 2})
    keyword = queue.enqueue(JOB_FUNCTION, request={"prompt": "hi", "max_tokens": 2})
    fields = queue.enqueue(JOB_FUNCTION, prompt="hi", max_tokens=2)
    handles = [h.producer.handle(j.id) for j in (positional, keyword, fields)]
    h.run_until(h.all_ended(handles))
    assert [Job.fetch(j.id, h.redis, serializer=JSONSerializer).return_value()["text"] for j in handles] == [
        "ab"
    ] * 3


def test_bad_jobs_fail_alone_with_a_clear_reason(h: Harness) -> None:
    good = h.producer.submit({"prompt": "fine", "max_tokens": 2})
    json_queue = Queue("kvrq", connection=h.redis, serializer=JSONSerializer)
    invalid = json_queue.enqueue(JOB_FUNCTION, {"prompt": "x", "max_tokens": 0})
    other = json_queue.enqueue("os.system", "true")
    pickled = Queue("kvrq", connection=h.redis).enqueue(JOB_FUNCTION, {"prompt": "x"})  # rq's default: pickle
    too_long = h.producer.submit({"prompt": "x", "max_tokens": 5000})
    explodes = h.producer.submit({"prompt": "BOOM", "max_tokens": 2})
    handles = [good] + [h.producer.handle(j.id) for j in (invalid, other, pickled)] + [too_long, explodes]
    h.run_until(h.all_ended(handles))
    assert good.result(timeout=1).text == "ab"
    reasons = []
    for handle in handles[1:]:
        with pytest.raises(JobFailedError) as info:
            handle.result(timeout=1)
        reasons.append(info.value.reason)
    assert reasons[0].startswith(
        "JobRejected: invalid request: max_tokens: Input should be greater than or equal to 1"
    )
    assert "runs worker.jobs.generate jobs only, not os.system" in reasons[1]
    assert "not JSON" in reasons[2]
    assert reasons[3].startswith("InvalidRequestError: prompt (1 tokens) + max_tokens (5000) exceeds")
    assert reasons[4] == "RuntimeError: kaboom in submit"
    with pytest.raises(JobFailedError, match="max_tokens"):
        list(h.producer.handle(invalid.id).stream(timeout=1))


def test_agent_jobs_run_in_order_and_resume_from_the_previous_cache(h: Harness) -> None:
    a1 = h.producer.submit({"agent_id": "A", "prompt": "hello", "max_tokens": 4})
    a2 = h.producer.submit({"agent_id": "A", "prompt": "hello" + "abcd" + " more", "max_tokens": 2})
    b1 = h.producer.submit({"agent_id": "B", "prompt": "other", "max_tokens": 2})
    h.loop.run_once()
    running = {held.id for held in h.loop.scheduler.running.values()}
    assert running == {a1.id, b1.id}  # A's second job waits, B is not held up behind it
    assert a2.status() == "started"
    h.run_until(h.all_ended([a1, a2, b1]))
    order = [(agent, reused) for agent, _, reused in h.engine.submitted]
    assert order == [("A", 0), ("B", 0), ("A", 9)]  # a2 reuses a1's prompt + answer
    assert a2.result(timeout=1).usage.reused_tokens == 9
    assert h.store.puts == ["B", "A", "A"] or h.store.puts == ["A", "B", "A"]
    assert not h.redis.keys("kvrq:agent-lock:*")


def test_a_taken_job_has_its_kv_buffers_reserved_before_its_turn_comes(h: Harness) -> None:
    """A job reserves its buffers when it is taken, not when it is submitted: one that waits for its
    agent's turn (or cache) has them made meanwhile, off the step thread (engine.reserve)."""
    first = h.producer.submit({"agent_id": "A", "prompt": "hello", "max_tokens": 4})
    second = h.producer.submit({"agent_id": "A", "prompt": "hello" + "abcd" + " more", "max_tokens": 2})
    h.loop.run_once()
    assert second.status() == "started" and second.id not in {
        held.id for held in h.loop.scheduler.running.values()
    }
    assert h.engine.reserved == [(5, 4), (14, 2)]
    h.run_until(h.all_ended([first, second]))


def test_full_pool_keeps_jobs_queued_not_failed() -> None:
    h = Harness(pool_blocks=3)  # one job of 4 prompt + 8 generated tokens takes all 3 blocks
    handles = [h.producer.submit({"prompt": "abcd", "max_tokens": 8}) for _ in range(3)]
    h.loop.run_once()
    assert h.statuses(handles) == ["started", "started", "queued"]  # one runs, one is held, one stays queued
    assert h.loop.scheduler.waiting[0].wait_reason == "KV blocks"
    h.run_until(h.all_ended(handles))
    assert h.statuses(handles) == ["finished"] * 3
    assert h.engine.max_active == 1


def test_a_job_larger_than_the_pool_fails() -> None:
    h = Harness(pool_blocks=3)
    big = h.producer.submit({"prompt": "abcd", "max_tokens": 40})
    h.run_until(h.all_ended([big]))
    with pytest.raises(JobFailedError, match="RequestTooLargeError"):
        big.result(timeout=1)


def test_cancel_queued_and_running_jobs_frees_blocks(h: Harness) -> None:
    running = h.producer.submit({"prompt": "x", "max_tokens": 1000})
    h.run_until(lambda: bool(h.loop.scheduler.running))
    queued = h.producer.submit({"prompt": "y", "max_tokens": 2})
    assert queued.cancel() is True
    assert queued.status() == "canceled"
    assert running.cancel() is True
    h.run_until(lambda: running.status() == "canceled")
    assert h.engine.pool.free_blocks == h.engine.pool.total_blocks
    assert not h.engine.has_work()
    with pytest.raises(JobCanceledError):
        running.result(timeout=1)
    assert list(running.events(timeout=1))[-1].finish_reason == "canceled"
    assert running.cancel() is False
    h.run_until(lambda: not h.redis.llen("rq:queue:kvrq"), 5)
    assert h.engine.submitted[-1][1] != list(b"y")  # the canceled queued job never reached the engine


def test_step_failure_fails_the_batch_and_the_worker_goes_on(h: Harness) -> None:
    a = h.producer.submit({"prompt": "STEPFAIL", "max_tokens": 3})
    h.run_until(h.all_ended([a]))
    with pytest.raises(JobFailedError, match="step exploded"):
        a.result(timeout=1)
    b = h.producer.submit({"prompt": "ok", "max_tokens": 2})
    h.run_until(h.all_ended([b]))
    assert b.result(timeout=1).text == "ab"


def test_job_timeout_fails_a_running_job() -> None:
    h = Harness()
    slow = h.producer.submit({"prompt": "x", "max_tokens": 4000, "job_timeout": 1})
    deadline = time.monotonic() + 10
    while slow.status() != "failed" and time.monotonic() < deadline:
        h.loop.run_once()
        time.sleep(0.01)
    with pytest.raises(JobFailedError, match="JobTimeoutException"):
        slow.result(timeout=1)
    assert not h.engine.has_work()


def test_drain_requeues_waiting_at_once_and_running_after_the_timeout() -> None:
    h = Harness(drain_timeout=0.0)
    first = h.producer.submit({"agent_id": "A", "prompt": "x", "max_tokens": 1000})
    second = h.producer.submit({"agent_id": "A", "prompt": "y", "max_tokens": 2})
    third = h.producer.submit({"prompt": "z", "max_tokens": 1000})
    h.loop.run_once()
    assert h.statuses([first, second, third]) == ["started"] * 3
    h.loop.request_stop()
    assert h.loop.run_once() is True  # drain_timeout 0: everything goes back at once
    assert h.statuses([first, second, third]) == ["queued"] * 3
    queue = Queue("kvrq", connection=h.redis, serializer=JSONSerializer)
    assert queue.get_job_ids() == [first.id, second.id, third.id]  # original order kept
    assert queue.started_job_registry.get_job_count() == 0
    assert not h.engine.has_work()
    # Another worker picks them up and streams restart cleanly.
    h.loop = h.new_loop()
    h.run_until(h.all_ended([first, second, third]), 3000)
    assert second.result(timeout=1).text == "ab"
    assert [e.kind for e in first.events(timeout=1)].count("start") == 2


def test_drain_lets_running_jobs_finish_within_the_timeout() -> None:
    h = Harness(drain_timeout=60.0)
    job = h.producer.submit({"prompt": "x", "max_tokens": 5})
    h.loop.run_once()
    h.loop.request_stop()
    later = h.producer.submit({"prompt": "y", "max_tokens": 5})
    for _ in range(20):
        if h.loop.run_once():
            break
    else:
        raise AssertionError("did not drain")
    assert job.status() == "finished"
    assert later.status() == "queued"
    h.loop.shutdown()
    assert h.store.closed


def test_jobs_whose_heartbeat_expired_are_rerun_from_their_crash_budget(h: Harness) -> None:
    # A live worker (its liveness key is set) whose loop stopped heartbeating its jobs.
    job = h.producer.submit({"prompt": "x", "max_tokens": 1000})
    h.loop.run_once()
    report = clean_queues(h.redis, ["kvrq"], now=time.time() + 3600)
    assert report.rerun["kvrq"] == [job.id]
    assert job.status() == "queued"
    assert job.job().get_meta()["kvrq_crashes"] == 1


def test_heartbeat_lets_go_of_a_job_rerun_elsewhere(h: Harness) -> None:
    job = h.producer.submit({"prompt": "x", "max_tokens": 1000})
    h.loop.run_once()
    clean_queues(h.redis, ["kvrq"], now=time.time() + 3600)  # declared stuck while alive
    assert job.status() == "queued"
    time.sleep(0.06)
    h.loop.run_once()  # heartbeat notices its execution is gone, lets go, and dequeues it again
    assert len(h.loop.scheduler) == 1
    assert job.status() == "started"
    assert h.loop.counts["dropped"] == 1


def test_redis_outage_loses_nothing(h: Harness) -> None:
    handles = [h.producer.submit({"prompt": f"p{i}", "max_tokens": 6}) for i in range(2)]
    h.loop.run_once()
    h.loop.run_once()
    h.server.connected = False
    for _ in range(3):
        with pytest.raises(Exception, match="onnection"):
            h.loop.run_once()
    h.server.connected = True
    h.run_until(h.all_ended(handles))
    for handle in handles:
        assert handle.result(timeout=1).text == "abcdef"
        assert "".join(handle.stream(timeout=1)) == "abcdef"


def run_in_thread(h: Harness) -> threading.Thread:
    runner = threading.Thread(target=h.loop.run, daemon=True)
    runner.start()
    return runner


def test_a_stopping_worker_holding_nothing_does_not_wait_for_redis(h: Harness) -> None:
    h.loop.run_once()
    h.loop.request_stop()
    h.server.connected = False  # a stack stopped all at once: Redis went first
    h.loop.upkeep.next_heartbeat = 0.0  # and a heartbeat is due: the loop has to reach Redis
    runner = run_in_thread(h)
    runner.join(timeout=5)
    assert not runner.is_alive(), "nothing held, nothing to write: it stopped without Redis"


def test_a_stopping_worker_holding_a_job_waits_for_redis_to_hand_it_back() -> None:
    h = Harness(drain_timeout=0.0)
    handle = h.producer.submit({"prompt": "x", "max_tokens": 1000})
    h.loop.run_once()
    h.loop.request_stop()
    h.server.connected = False
    runner = run_in_thread(h)
    runner.join(timeout=1.5)
    assert runner.is_alive(), "a held job would be lost: it waits out the outage"
    h.server.connected = True
    runner.join(timeout=30)
    assert not runner.is_alive()
    assert handle.status() == "queued", "handed back once Redis returned"


def test_an_ending_a_failover_dropped_is_written_again_once(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a failover does to writes the replica had not received: the new primary holds the state from
    before them. Simulated by a snapshot of the whole server taken just before the job's ending is
    written and put back when the loop asks a replica (worker/fleet/confirmed_endings.py): the job is STARTED
    again there, and the loop writes its ending once more, on the "new primary"."""
    handle = h.producer.submit({"prompt": "x", "max_tokens": 3})
    snapshot: dict[bytes, bytes] = {}
    write_ending = h.loop.endings.write
    dropped: list[tuple[HeldJob, Outcome]] = []

    def snapshot_then_write(held: HeldJob, outcome: Outcome) -> Outcome:
        if not snapshot and held.id == handle.id:
            snapshot.update({key: h.redis.dump(key) for key in h.redis.keys("*")})
            dropped.append((held, outcome))
        return write_ending(held, outcome)

    def lost_once() -> list[Lost]:
        if not dropped:
            return []
        h.redis.flushall()
        for key, value in snapshot.items():
            h.redis.restore(key, 0, value)
        return [Lost(*dropped.pop(), frozenset({"stream", "rq", "turn"}))]

    monkeypatch.setattr(h.loop.endings, "write", snapshot_then_write)
    monkeypatch.setattr(h.loop.confirmed, "lost", lost_once)
    h.run_until(
        lambda: bool(snapshot) and not dropped and not h.loop.ending and handle.status() == "finished"
    )
    assert handle.result(timeout=1).text == "abc"
    assert h.loop.counts["endings_rewritten"] == 1
    assert h.loop.counts["finished"] == 1  # counted once
    assert [e.kind for e in stored_events(h, handle)].count("end") == 1  # the whole stream, as stored
    queue = Queue("kvrq", connection=h.redis, serializer=JSONSerializer)
    assert queue.finished_job_registry.get_job_ids() == [handle.id]
    assert queue.started_job_registry.get_job_count() == 0


def test_an_agent_turn_release_a_failover_dropped_is_made_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failover that kept a job's ending but dropped its agent lock's release (the release comes
    after the ending in the replication stream): the new primary holds the lock for a job that ended.
    Simulated by a snapshot taken just before the release, put back when the loop asks a replica. The
    loop releases again, so the agent's next turn, on another worker, starts at once instead of
    waiting out the lock's TTL (90 s)."""
    h = Harness(affinity=False)  # the next turn may land on the other worker
    h.loop.turns._released.replicas = 1  # as on a Sentinel URL's `wait=1`
    snapshot: dict[bytes, bytes] = {}
    failovers: list[bool] = []
    release = h.loop.turns.release

    def snapshot_then_release(agent_id: str, job_id: str) -> None:
        if not snapshot:
            snapshot.update({key: h.redis.dump(key) for key in h.redis.keys("*")})
        release(agent_id, job_id)

    def read_after_failover(
        connection: Any, replicas: int, timeout_ms: int, reads: Any
    ) -> tuple[int, list[Any]]:
        if snapshot and not failovers:
            failovers.append(True)
            h.redis.flushall()
            for key, value in snapshot.items():
                h.redis.restore(key, 0, value)
        with connection.pipeline(transaction=False) as pipe:
            reads(pipe)
            return 1, pipe.execute()

    monkeypatch.setattr(h.loop.turns, "release", snapshot_then_release)
    monkeypatch.setattr("worker.fleet.replica_reads.read_after_wait", read_after_failover)
    first = h.producer.submit({"agent_id": "A", "prompt": "x", "max_tokens": 3})
    h.run_until(lambda: bool(failovers) and first.status() == "finished" and not h.loop.turns._released)
    assert h.loop.counts["releases_rewritten"] == 1
    assert not h.redis.exists(agent_lock_key("A"))
    other = h.new_loop(FakeEngine())
    second = h.producer.submit({"agent_id": "A", "prompt": "xy", "max_tokens": 2})
    for _ in range(100):
        other.beacon.beat()
        other.run_once()
        if second.status() == "finished":
            break
    assert second.status() == "finished", "the next turn waits for the lock's TTL"


def test_a_job_whose_start_fails_after_its_dequeue_is_not_lost(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis goes away between a job's dequeue and its start (a failover's CLIENT KILL): the job is in
    rq's intermediate queue, not in no list at all (rq's LPOP for several queues lost it: QUEUED, in
    no queue, nobody to run it; the 20-round failover chaos run met it), and maintenance puts it back
    on its queue once it has been stranded there a minute."""
    assert len(h.loop.worker.queues) == 2  # its own queue and the shared one: the LMOVE path
    handle = h.producer.submit({"prompt": "x", "max_tokens": 3})
    start_job = rqexec.start_job
    failures: list[str] = []

    def start_fails_once(worker: Any, job: Job, queue: Queue) -> Any:
        if not failures:
            failures.append(job.id)
            raise RedisConnectionError("Connection closed by server.")
        return start_job(worker, job, queue)

    monkeypatch.setattr(rqexec, "start_job", start_fails_once)
    with pytest.raises(RedisConnectionError):
        h.loop.run_once()
    queue = Queue("kvrq", connection=h.redis, serializer=JSONSerializer)
    assert failures == [handle.id] and handle.status() == "queued"
    assert queue.get_job_ids() == [] and queue.intermediate_queue.get_job_ids() == [handle.id]
    intermediate = queue.intermediate_queue
    h.redis.set(intermediate.get_first_seen_key(handle.id), time.time() - 120)  # stranded a while
    assert clean_queues(h.redis, ["kvrq"]).rescued == {"kvrq": [handle.id]}
    h.run_until(lambda: handle.status() == "finished")
    assert handle.result(timeout=1).text == "abc"
