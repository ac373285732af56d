"""A worker that starts while Redis refuses writes (a failover's NOREPLICAS window) waits, then registers.

Before, `WorkerLoop.start()` registered outside the loop's outage handling: a worker (re)started during a
queue failover exited on the first NOREPLICAS. And the loop's backoff doubled to 8-16 s during that
window, so a worker slept long after the new primary took writes again (worker/loop/backoff.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from producer.wire.redis_url import WriteRefusedError
from tests.worker.harness import Harness
from worker.jobs.rqexec import KvrqWorker
from worker.loop.backoff import REFUSED_CAP_S, Backoff
from worker.loop.worker_loop import WorkerLoop


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[float]]:
    slept: list[float] = []
    monkeypatch.setattr("worker.loop.worker_loop.time.sleep", slept.append)
    yield slept


def unregistered_loop(h: Harness) -> WorkerLoop:
    worker = KvrqWorker(["kvrq"], connection=h.redis, heartbeat_ttl=h.settings.heartbeat_ttl)
    return WorkerLoop(
        engine=h.engine,
        store=h.store,
        rq_worker=worker,
        settings=h.settings,
        model_name="fake",
        idle_wait_s=0,
    )


def refusing(times: int, action: object, error: Exception) -> object:
    """`action`, raising `error` on its first `times` calls."""
    calls = {"n": 0}

    def wrapped(*args: object, **kwargs: object) -> object:
        calls["n"] += 1
        if calls["n"] <= times:
            raise error
        return action(*args, **kwargs)  # type: ignore[operator]

    return wrapped


def test_start_waits_out_refused_writes_then_registers_once(
    sleeps: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    h = Harness()
    loop = unregistered_loop(h)
    refused = WriteRefusedError("NOREPLICAS Not enough good replicas to write.")
    monkeypatch.setattr(loop.worker, "register_birth", refusing(5, loop.worker.register_birth, refused))
    subscribed: list[int] = []
    monkeypatch.setattr(loop.worker, "subscribe", refusing(2, lambda: subscribed.append(1), refused))
    loop.start()
    try:
        assert h.redis.sismember("rq:workers", loop.worker.key)
        assert loop.worker.get_state() == "idle"
        assert subscribed == [1]  # one pubsub thread, not one per try
        assert len(sleeps) == 7 and max(sleeps) <= REFUSED_CAP_S
        assert loop.backoff.failures == 0  # reset for run()
    finally:
        loop.beacon.stop()


def test_a_stop_requested_while_waiting_leaves_start(
    sleeps: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    h = Harness()
    loop = unregistered_loop(h)

    def down() -> None:
        loop.request_stop()
        raise RedisConnectionError("Connection refused")

    monkeypatch.setattr(loop.worker, "register_birth", down)
    loop.start()
    assert loop.draining and len(sleeps) == 1
    assert not h.redis.sismember("rq:workers", loop.worker.key)


def test_refused_writes_wait_at_most_a_second_other_outages_back_off_to_the_cap() -> None:
    backoff = Backoff()
    refused = [backoff.next(WriteRefusedError("READONLY")) for _ in range(8)]
    assert refused[0] == 0.5 and max(refused) == REFUSED_CAP_S
    backoff.reset()
    down = [backoff.next(RedisConnectionError("gone")) for _ in range(8)]
    assert down == [0.5, 1, 2, 4, 8, 16, 30, 30]
