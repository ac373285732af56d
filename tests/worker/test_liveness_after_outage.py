"""A worker whose liveness key expired while Redis was away (an outage longer than `liveness_ttl`)
is still alive: its own crash check must not take it for dead and re-run the jobs it holds.

On fakeredis: the key is deleted as the outage would have let it expire; the beacon thread is
not running in the harness, as it may not have beaten yet when the loop gets Redis back.
"""

from __future__ import annotations

import threading
import time

import pytest

from producer.wire.protocol import worker_alive_key
from tests.worker.chaos_checks import attempts, crash_reruns
from tests.worker.fakes import FakeEngine
from tests.worker.harness import Harness
from worker.loop.held import HeldJob
from worker.loop.outcomes import Outcome


def test_a_worker_back_from_an_outage_does_not_rerun_its_own_jobs() -> None:
    h = Harness()
    job = h.producer.submit({"prompt": "x", "max_tokens": 20})
    h.run_until(lambda: h.loop.counts["tokens"] >= 3)
    h.redis.delete(worker_alive_key(h.loop.worker.name))  # expired during the outage
    h.loop.upkeep.next_crash_check = 0.0  # the check is due when the loop gets Redis back
    h.run_until(h.all_ended([job]))
    assert job.status() == "finished"
    assert attempts(h.redis, job.id) == 1
    assert h.loop.counts["dropped"] == 0


@pytest.mark.parametrize("check", ["crash check", "maintenance"])
def test_after_an_outage_a_worker_does_not_rerun_a_live_peers_jobs(check: str) -> None:
    """Both workers lost Redis; the peer's key expired meanwhile and its beacon has not beaten yet.

    Measured by benchmarks/chaos.py (a 30 s outage, two workers): before the fix, 6 of 32 jobs
    were re-run, and the live peer was dropped from rq's worker registry. Maintenance re-runs dead
    workers' jobs too (clean_queues): the 20-round failover chaos run saw a job failed as crashed
    three times while every worker lived, with maintenance due as writes came back.
    """
    often = {"crash check": "crash_check_interval", "maintenance": "maintenance_interval"}[check]
    h = Harness(liveness_ttl=2, **{"crash_check_interval": 3600.0, often: 0.05})
    peer = h.loop
    job = h.producer.submit({"prompt": "x", "max_tokens": 200})
    h.run_until(lambda: peer.counts["tokens"] >= 1)  # the peer holds the job; it is not driven here
    checker = h.new_loop(FakeEngine())
    checker.run_once()
    runner = threading.Thread(target=checker.run, daemon=True)
    runner.start()
    h.server.connected = False  # the outage: Redis gone for both
    time.sleep(0.3)
    h.redis.connection_pool.disconnect()
    h.server.connected = True
    h.redis.delete(worker_alive_key(peer.worker.name))  # expired while Redis was away
    time.sleep(1.0)  # the checker is back (its first retry comes after 0.5 s); the peer not yet
    try:
        assert crash_reruns(h.redis, job.id) == 0
        assert job.status() == "started" and h.redis.sismember("rq:workers", peer.worker.key)
    finally:
        checker.request_stop()
        checker.request_stop()  # hand back at once
        runner.join(timeout=10)


def test_a_worker_cut_off_and_taken_for_dead_registers_again_when_back() -> None:
    h = Harness(crash_check_interval=0.05)
    cut_off = h.loop
    h.producer.submit({"prompt": "x", "max_tokens": 200})
    h.run_until(lambda: cut_off.counts["tokens"] >= 1)  # it holds a job
    other = h.new_loop(FakeEngine())
    h.redis.delete(worker_alive_key(cut_off.worker.name))  # it could not refresh its key
    other.run_once()  # takes it for dead
    assert not h.redis.sismember("rq:workers", cut_off.worker.key)
    for _ in range(5):  # back: its loop and beacon run again
        cut_off.beacon.beat()
        cut_off.upkeep.next_heartbeat = 0.0
        cut_off.run_once()
    assert h.redis.sismember("rq:workers", cut_off.worker.key)


def test_a_worker_back_from_an_outage_beats_before_it_writes_an_ending() -> None:
    """Its key expired during the outage, and its beacon thread may not beat for a while: the loop beats
    first, so a client whose job ends right after the outage (kvrq serve's next request asks which
    workers are live) never finds it missing. The harness runs no beacon thread: only the loop beats."""
    h = Harness()
    job = h.producer.submit({"prompt": "x", "max_tokens": 200})
    h.run_until(lambda: h.loop.counts["tokens"] >= 1)
    key = worker_alive_key(h.loop.worker.name)
    seen_at_ending: list[int] = []
    write_ending = h.loop.endings.write

    def ending(held: HeldJob, outcome: Outcome) -> Outcome:
        seen_at_ending.append(int(h.redis.exists(key)))
        return write_ending(held, outcome)

    h.loop.endings.write = ending  # type: ignore[method-assign]
    runner = threading.Thread(target=h.loop.run, daemon=True)
    h.redis.delete(key)  # as if it expired during the outage
    h.server.connected = False  # the outage
    runner.start()
    time.sleep(0.3)
    h.server.connected = True
    try:
        deadline = time.monotonic() + 5
        while not h.redis.exists(key):
            assert time.monotonic() < deadline, "the loop never beat after the outage"
            time.sleep(0.01)
        h.producer.handle(job.id).cancel()
        deadline = time.monotonic() + 5
        while not seen_at_ending:
            assert time.monotonic() < deadline, "the job never ended"
            time.sleep(0.01)
        assert seen_at_ending == [1]
    finally:
        h.loop.request_stop()
        h.loop.request_stop()
        runner.join(timeout=10)
