"""`kill -9` of real `kvrq worker` processes holding jobs: nothing is lost, failed or delivered twice.

Workers here run with a short liveness TTL (2 s) and crash check (1 s), so a dead worker's jobs
are re-queued within ~3 s (the defaults, 10 s and 5 s, are measured in benchmarks/chaos.py).
Every test starts its own redis-server and workers (builtin SmolLM2). A job that ran twice shows
two `start` events in its stream; it still has one rq Result and one end event.

`-m chaos` adds many rounds of the same (test_kill_9_rounds).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis import Redis
from rq import Queue
from rq.serializers import JSONSerializer

from producer.client import JobFailedError, JobHandle, Producer
from producer.wire.protocol import JOB_FUNCTION, worker_agents_key
from tests.worker.chaos_checks import ENDED, attempts, crash_reruns, deliveries, stream_events, summary
from tests.worker.procs import RedisProcess, WorkerProcess, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FAST_LIVENESS = {"KVRQ_LIVENESS_TTL": "2", "KVRQ_CRASH_CHECK_INTERVAL": "1"}
STORY = "Once upon a time, in a small village by the sea,"
QUESTION = [{"role": "user", "content": "Describe the sea in a few words."}]
FOLLOW_UP = {"role": "user", "content": "And the sky?"}


class Fleet:
    """The workers a test starts (all killed at its end), named in start order."""

    def __init__(self, redis_url: str, workdir: Path) -> None:
        self.redis_url = redis_url
        self.workdir = workdir
        self.started: list[WorkerProcess] = []

    def start(self, env: dict[str, str] | None = None) -> WorkerProcess:
        worker = WorkerProcess(
            self.redis_url,
            self.workdir,
            name=f"kvrq-crash-{len(self.started) + 1}",
            env={**FAST_LIVENESS, **(env or {})},
        )
        self.started.append(worker)
        return worker.start()

    def by_name(self, name: str) -> WorkerProcess:
        return next(w for w in self.started if w.name == name)


@pytest.fixture
def fleet(redis_proc: RedisProcess, tmp_path: Path) -> Iterator[Fleet]:
    workers = Fleet(redis_proc.url, tmp_path)
    yield workers
    for worker in workers.started:
        worker.stop()


def holder(connection: Redis, job_id: str) -> str | None:
    """The worker running the job now (rq's worker_name on a started job)."""
    status, name = (_text(v) for v in connection.hmget(f"rq:job:{job_id}", ["status", "worker_name"]))
    return name if status == "started" and name else None


def generating(connection: Redis, job_id: str, attempt: int = 1) -> bool:
    """The job's `attempt`-th run has streamed at least one token."""
    events = stream_events(connection, job_id)
    starts = [i for i, e in enumerate(events) if e.kind == "start"]
    return len(starts) >= attempt and any(e.kind == "delta" for e in events[starts[attempt - 1] :])


def forgotten(connection: Redis, worker: str) -> bool:
    """The dead worker left no rq record and no agent lock behind."""
    locks = [_text(connection.get(key)) for key in connection.scan_iter("kvrq:agent-lock:*")]
    return (
        not connection.sismember("rq:workers", f"rq:worker:{worker}")
        and not connection.exists(f"rq:worker:{worker}")
        and not connection.exists(worker_agents_key(worker))
        and not any(lock is not None and lock.startswith(f"{worker}/") for lock in locks)
    )


def _text(value: bytes | str | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


def statuses(handles: list[JobHandle]) -> list[str]:
    return [h.status() for h in handles]


def wait_all_ended(handles: list[JobHandle], timeout: float = 240) -> None:
    try:
        wait_for(lambda: all(s in ENDED for s in statuses(handles)), timeout, "")
    except AssertionError:
        raise AssertionError(f"jobs never ended: {statuses(handles)}") from None


def test_kill_9_with_a_second_worker_alive(producer: Producer, fleet: Fleet) -> None:
    first, second = fleet.start(), fleet.start()
    connection = producer.connection
    # The answer the agent's first turn will give (greedy: the same on any worker, in any batch).
    answer = producer.submit({"messages": QUESTION, "max_tokens": 16}).result(timeout=120).text
    turn_1 = producer.submit({"agent_id": "crash-a", "messages": QUESTION, "max_tokens": 16})
    fillers = producer.submit_many([{"prompt": STORY, "max_tokens": 32} for _ in range(7)])
    turn_2 = producer.submit(
        {
            "agent_id": "crash-a",
            "messages": [*QUESTION, {"role": "assistant", "content": answer}, FOLLOW_UP],
            "max_tokens": 8,
        }
    )
    wait_for(lambda: generating(connection, turn_1.id), 120, "the agent's first turn did not start")
    victim = fleet.by_name(holder(connection, turn_1.id) or "")
    survivor = second if victim is first else first
    held = [h for h in [turn_1, *fillers] if holder(connection, h.id) == victim.name]
    streamed = [h for h in held if attempts(connection, h.id) == 1]  # its first run reached the stream
    victim.kill()

    everything = [turn_1, *fillers, turn_2]
    wait_all_ended(everything)
    delivered = deliveries(everything)
    assert summary(delivered)["finished"] == len(everything), delivered
    assert all(d.finished_once for d in delivered), delivered
    assert [crash_reruns(connection, h.id) for h in held] == [1] * len(held)
    assert all(attempts(connection, h.id) == 2 for h in streamed)  # the re-run shows as a new attempt
    r1, r2 = turn_1.result(timeout=5), turn_2.result(timeout=5)
    assert r1.worker == survivor.name and r1.text == answer
    # The agent's next turn did not overtake the re-run: it resumed from the re-run's prompt + answer.
    assert r2.usage.reused_tokens >= r1.usage.prompt_tokens + r1.usage.generated_tokens - 2
    assert "re-queued" in survivor.log() or "re-queued" in victim.log()
    wait_for(lambda: forgotten(connection, victim.name), 10, "the dead worker's record or locks remain")
    assert not survivor.exited()


def test_kill_9_with_no_worker_alive_and_a_poison_job(producer: Producer, fleet: Fleet) -> None:
    connection = producer.connection
    first = fleet.start()
    queue = Queue("kvrq", connection=connection, serializer=JSONSerializer)
    # Poison: it kills every worker that holds it (the test does the killing); one crash re-run allowed.
    poison = producer.handle(
        queue.enqueue_call(
            JOB_FUNCTION, args=({"prompt": STORY, "max_tokens": 400},), meta={"kvrq_crash_reruns": 1}
        ).id
    )
    others = producer.submit_many(
        [{"prompt": STORY, "max_tokens": 32}] * 3
        + [{"agent_id": "crash-b", "messages": QUESTION, "max_tokens": 12}]
    )
    wait_for(lambda: generating(connection, poison.id), 120, "the poison job did not start")
    held_first = [h for h in others if holder(connection, h.id) == first.name]
    streamed_first = [h for h in held_first if attempts(connection, h.id) == 1]
    first.kill()

    time.sleep(4)  # twice the liveness TTL: nobody is alive to re-run anything
    assert statuses([poison, *held_first]) == ["started"] * (1 + len(held_first))

    second = fleet.start()  # its crash check at start re-runs what the dead worker held
    wait_for(lambda: holder(connection, poison.id) == second.name, 60, "the poison job was not re-run")
    wait_for(lambda: generating(connection, poison.id, attempt=2), 60, "the re-run did not generate")
    second.kill()  # the poison job's second crash: its budget of one re-run is spent

    third = fleet.start()
    wait_all_ended([poison, *others])
    with pytest.raises(JobFailedError) as failure:
        poison.result(timeout=5)
    assert failure.value.code == "worker_crashed"
    assert "died 2 times" in failure.value.reason
    delivered = deliveries(others)
    assert summary(delivered)["finished"] == len(others), delivered
    assert all(d.finished_once for d in delivered), delivered
    assert all(crash_reruns(connection, h.id) >= 1 for h in held_first)
    assert all(attempts(connection, h.id) >= 2 for h in streamed_first)
    assert all(h.result(timeout=5).worker in (second.name, third.name) for h in held_first)
    for dead in (first, second):
        wait_for(lambda: forgotten(connection, dead.name), 10, f"{dead.name}'s record or locks remain")  # noqa: B023
    assert not third.exited()


@pytest.mark.chaos
def test_kill_9_rounds(producer: Producer, fleet: Fleet) -> None:
    """Many rounds: kill -9 a worker holding jobs at a random moment, start a new one.

    Each round's jobs end before the next round, so each is killed at most once: within its crash
    budget, every one must finish (jobs killed more often than the budget fail by design).
    """
    rounds = int(os.environ.get("KVRQ_CHAOS_ROUNDS", "10"))
    rng = random.Random(7)
    connection = producer.connection
    alive = [fleet.start(), fleet.start()]
    everything: list[JobHandle] = []
    for round_ in range(rounds):
        batch: list[dict[str, Any]] = [
            {"prompt": STORY, "max_tokens": rng.randint(8, 64)} for _ in range(12)
        ] + [
            {"agent_id": f"round-agent-{i}", "messages": QUESTION, "max_tokens": rng.randint(4, 24)}
            for i in range(4)
        ]
        handles = producer.submit_many(batch)
        everything += handles
        time.sleep(rng.uniform(0.5, 8))
        holders = {holder(connection, h.id) for h in handles} - {None}
        victim = next((w for w in alive if w.name in holders), alive[round_ % 2])
        victim.kill()
        alive = [w for w in alive if w is not victim] + [fleet.start()]
        wait_all_ended(handles)
    delivered = deliveries(everything)
    counts = summary(delivered)
    assert counts["finished"] == len(everything), (counts, [d for d in delivered if not d.finished_once])
    assert all(d.finished_once for d in delivered)
    assert counts["duplicated"] == 0 and counts["lost"] == 0 and counts["crash_rerun"] > 0
