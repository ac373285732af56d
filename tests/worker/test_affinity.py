"""Agent affinity on fakeredis: an agent's next job goes to the worker holding its cache hot."""

from __future__ import annotations

from producer.wire.protocol import agent_home_key, worker_alive_key, worker_queue_name
from tests.worker.fakes import FakeEngine
from tests.worker.harness import Harness


def test_an_agents_next_job_goes_to_the_worker_that_holds_it_hot() -> None:
    h = Harness()
    first = h.producer.submit({"agent_id": "A", "prompt": "hi", "max_tokens": 2})
    h.run_until(h.all_ended([first]))
    home = h.loop.worker.name
    assert h.redis.get(agent_home_key("A")) == home.encode()
    other = h.new_loop(FakeEngine())
    second = h.producer.submit({"agent_id": "A", "prompt": "hiab!", "max_tokens": 2})
    assert second.job().origin == worker_queue_name("kvrq", home)
    one_off = h.producer.submit({"prompt": "x", "max_tokens": 2})
    assert one_off.job().origin == "kvrq"  # no agent: the shared queue
    for _ in range(5):
        other.run_once()  # the other worker leaves it alone (its home is alive and not slow)
    assert second.status() == "queued" and one_off.status() == "finished"
    h.run_until(h.all_ended([second]))
    assert second.result(timeout=1).worker == home
    assert second.result(timeout=1).usage.reused_tokens == 4


def test_a_dead_homes_jobs_go_to_another_worker_at_once() -> None:
    h = Harness()
    first = h.producer.submit({"agent_id": "A", "prompt": "hi", "max_tokens": 2})
    h.run_until(h.all_ended([first]))
    second = h.producer.submit({"agent_id": "A", "prompt": "hiab!", "max_tokens": 2})
    h.redis.delete(worker_alive_key(h.loop.worker.name))  # the home worker dies
    h.loop = h.new_loop(FakeEngine())
    h.run_until(h.all_ended([second]), 20)
    assert second.result(timeout=1).worker == h.loop.worker.name
    third = h.producer.submit({"agent_id": "A", "prompt": "hiab!ab?", "max_tokens": 2})
    assert third.job().origin == worker_queue_name("kvrq", h.loop.worker.name)  # the new home


def test_a_busy_homes_jobs_go_to_another_worker_after_the_wait() -> None:
    h = Harness(affinity_wait=0.0)
    first = h.producer.submit({"agent_id": "A", "prompt": "hi", "max_tokens": 2})
    h.run_until(h.all_ended([first]))
    second = h.producer.submit({"agent_id": "A", "prompt": "hiab!", "max_tokens": 2})
    other = h.new_loop(FakeEngine())
    for _ in range(20):
        other.run_once()  # the home worker is alive but does not run (busy elsewhere)
        if second.status() == "finished":
            break
    assert second.result(timeout=1).worker == other.worker.name


def test_affinity_off_sends_everything_to_the_shared_queue() -> None:
    h = Harness(affinity=False)
    first = h.producer.submit({"agent_id": "A", "prompt": "hi", "max_tokens": 2})
    h.run_until(h.all_ended([first]))
    assert not h.redis.exists(agent_home_key("A"))
    second = h.producer.submit({"agent_id": "A", "prompt": "hiab!", "max_tokens": 2})
    assert second.job().origin == "kvrq"
