"""Crash re-runs and agent turns across workers, on fakeredis: several worker loops, one Redis.

A worker "dies" here by losing its liveness key and no longer being driven; real processes
killed with `kill -9` are in test_integration_crash.py.
"""

from __future__ import annotations

import pytest
from rq import Queue
from rq.serializers import JSONSerializer

from producer.client import JobFailedError
from producer.wire.protocol import JOB_FUNCTION, agent_lock_key, worker_alive_key
from tests.worker.fakes import DictStore, FakeEngine
from tests.worker.harness import Harness
from worker.loop.worker_loop import WorkerLoop


def kill(h: Harness, loop: WorkerLoop) -> None:
    """The worker is gone: its liveness key expires, nothing drives its loop any more."""
    h.redis.delete(worker_alive_key(loop.worker.name))


def start_events(h: Harness, job_id: str) -> int:
    return [e.kind for e in h.producer.handle(job_id).events(timeout=1)].count("start")


def test_a_dead_workers_job_reruns_on_another_worker_and_finishes_once() -> None:
    h = Harness()
    job = h.producer.submit({"agent_id": "A", "prompt": "x", "max_tokens": 40})
    for _ in range(3):
        h.loop.run_once()
    dead = h.loop
    assert job.status() == "started" and h.redis.exists(agent_lock_key("A"))
    kill(h, dead)
    survivor = h.new_loop(FakeEngine())
    h.loop = survivor
    h.run_until(h.all_ended([job]))
    result = job.result(timeout=1)
    assert result.text == ("abcdefghijklmnopqrstuvwxyz" * 2)[:40]
    assert result.worker == survivor.worker.name
    assert start_events(h, job.id) == 2  # the stream marks the new attempt
    assert job.job().get_meta()["kvrq_crashes"] == 1
    assert not h.redis.exists(f"rq:worker:{dead.worker.name}")  # rq and dashboards forget the dead worker
    queue = Queue("kvrq", connection=h.redis, serializer=JSONSerializer)
    assert queue.finished_job_registry.get_job_count() == 1
    assert queue.started_job_registry.get_job_count() == 0


def test_a_job_that_keeps_killing_workers_fails_after_its_crash_budget() -> None:
    h = Harness()
    queue = Queue("kvrq", connection=h.redis, serializer=JSONSerializer)
    poison = queue.enqueue(JOB_FUNCTION, {"prompt": "x", "max_tokens": 1000}, meta={"kvrq_crash_reruns": 1})
    for _ in range(2):  # the first run and its one re-run each kill their worker
        h.run_until(lambda: poison.get_status() == "started")
        kill(h, h.loop)
        h.loop = h.new_loop(FakeEngine())
        h.loop.run_once()  # the crash check of a live worker
    h.run_until(lambda: poison.get_status() == "failed", 5)
    with pytest.raises(JobFailedError) as info:
        h.producer.handle(poison.id).result(timeout=1)
    assert info.value.code == "worker_crashed"
    assert "died 2 times" in str(info.value)


def test_an_agents_job_waiting_for_kv_blocks_is_not_overtaken_by_another_worker() -> None:
    h = Harness(pool_blocks=3, affinity=False)  # the fake's blocks hold 4 tokens: 12 tokens in all
    blocker = h.producer.submit({"prompt": "abcd", "max_tokens": 8})
    first = h.producer.submit({"agent_id": "A", "prompt": "abcd", "max_tokens": 8})
    h.loop.run_once()
    assert h.loop.scheduler.waiting[0].id == first.id  # held, waiting for KV blocks
    second = h.producer.submit({"agent_id": "A", "prompt": "abcd" + "abcdefgh" + "more", "max_tokens": 2})
    other = h.new_loop(FakeEngine(pool_blocks=64))
    other.run_once()
    (waiting,) = other.scheduler.waiting
    assert waiting.id == second.id and "agent's turn" in waiting.wait_reason
    for _ in range(200):
        if all(j.status() == "finished" for j in (blocker, first, second)):
            break
        h.loop.run_once()
        other.run_once()
    assert [j.status() for j in (blocker, first, second)] == ["finished"] * 3
    # The second job ran after the first and resumed from its prompt + answer.
    assert second.result(timeout=1).usage.reused_tokens == 12


def test_the_agents_lock_is_held_until_its_cache_is_durable() -> None:
    h = Harness(affinity=False)  # the next job may land on the other worker
    h.store = DictStore(durable=False)
    h.loop = h.new_loop()
    first = h.producer.submit({"agent_id": "A", "prompt": "hi", "max_tokens": 2})
    h.run_until(h.all_ended([first]))
    assert h.redis.exists(agent_lock_key("A"))  # answered, but the put is still pending
    second = h.producer.submit({"agent_id": "A", "prompt": "hiab!", "max_tokens": 2})
    other = h.new_loop(FakeEngine())
    other.run_once()
    assert "agent's turn" in other.scheduler.waiting[0].wait_reason
    h.store.settle()
    h.loop.run_once()  # sees the put durable, releases the lock
    assert not h.redis.exists(agent_lock_key("A"))
    for _ in range(50):
        other.run_once()
    assert second.result(timeout=1).usage.reused_tokens == 4
    assert [fence for _, fence in h.store.fences] == [1, 2]  # each turn fences its own put


def test_the_same_worker_passes_the_turn_to_the_agents_next_job_while_the_put_is_pending() -> None:
    h = Harness()
    h.store = DictStore(durable=False)
    h.loop = h.new_loop()
    first = h.producer.submit({"agent_id": "A", "prompt": "hi", "max_tokens": 2})
    second = h.producer.submit({"agent_id": "A", "prompt": "hiab!", "max_tokens": 2})
    h.run_until(h.all_ended([first, second]))
    assert second.result(timeout=1).usage.reused_tokens == 4
    assert h.store.prefetches == ["A", "A"]  # read off the step thread, before admission
    assert second.result(timeout=1).timings.cache_load_s < 0.05
    h.store.settle()
    h.loop.run_once()
    assert not h.redis.exists(agent_lock_key("A"))


def test_failed_jobs_carry_an_error_code() -> None:
    h = Harness(pool_blocks=8)
    invalid = h.producer.handle(
        Queue("kvrq", connection=h.redis, serializer=JSONSerializer).enqueue(JOB_FUNCTION, {"prompt": ""}).id
    )
    too_large = h.producer.submit({"prompt": "x", "max_tokens": 500})
    crashes = h.producer.submit({"prompt": "STEPFAIL", "max_tokens": 3})
    h.run_until(h.all_ended([invalid, too_large, crashes]))
    codes = []
    for handle in (invalid, too_large, crashes):
        with pytest.raises(JobFailedError) as info:
            handle.result(timeout=1)
        codes.append(info.value.code)
    assert codes == ["invalid_request", "context_length_exceeded", "engine_error"]
