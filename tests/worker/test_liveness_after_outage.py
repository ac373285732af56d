"""A worker whose liveness key expired while Redis was away (an outage longer than `liveness_ttl`)
is still alive: its own crash check must not take it for dead and re-run the jobs it holds.

On fakeredis: the key is deleted as the outage would have let it expire; the beacon thread is
not running in the harness, as it may not have beaten yet when the loop gets Redis back.
"""

from __future__ import annotations

import threading
import time

import pytest

from producer.protocol import worker_alive_key
from tests.worker.chaos_checks import attempts, crash_reruns
from tests.worker.fakes import FakeEngine
from tests.worker.harness import Harness


def test_a_worker_back_from_an_outage_does_not_rerun_its_own_jobs() -> None:
    h = Harness()
    job = h.producer.submit({"prompt": "x", "max_tokens": 20})
    h.run_until(lambda: h.loop.counts["tokens"] >= 3)
    h.redis.delete(worker_alive_key(h.loop.worker.name))  # expired during the outage
    h.loop.next_crash_check = 0.0  # the check is due when the loop gets Redis back
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
        cut_off.next_heartbeat = 0.0
        cut_off.run_once()
    assert h.redis.sismember("rq:workers", cut_off.worker.key)
