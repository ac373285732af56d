"""The scheduler's policy alone: no Redis, no model, a fake engine answering admission."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

from engine.core.admission import Admission
from engine.core.params import SamplingParams
from tests.worker.fakes import FakeEngine
from worker.loop.held import HeldJob
from worker.loop.scheduler import Scheduler


def held(
    job_id: str, agent: str | None, first: float, prompt: int = 4, max_tokens: int = 4, enqueued: float = 0.0
) -> HeldJob:
    fake: Any = SimpleNamespace(id=job_id)
    return HeldJob(
        job=fake,
        queue=cast(Any, None),
        execution=cast(Any, None),
        request=cast(Any, SimpleNamespace(agent_id=agent)),
        sampling=SamplingParams(max_tokens=max_tokens),
        prompt_tokens=[1] * prompt,
        enqueued_at=enqueued or first,
        first_enqueued_at=first,
        held_at=0.0,
    )


def ids(jobs: list[HeldJob]) -> list[str]:
    return [h.id for h in jobs]


def test_an_agents_earliest_job_is_its_only_candidate_even_when_taken_last() -> None:
    scheduler = Scheduler(held_limit=8)
    later = held("a2", "A", first=2.0)
    rerun = held("a1", "A", first=1.0)  # re-queued after a crash, dequeued after a2
    other = held("b1", "B", first=3.0)
    for job in (later, other, rerun):
        scheduler.add(job)
    assert ids(scheduler.candidates()) == ["b1", "a1"]


def test_order_is_the_first_enqueue_not_the_last() -> None:
    """Jobs handed back by a drain are re-enqueued newest first: rq's enqueued_at then runs backwards."""
    scheduler = Scheduler(held_limit=8)
    scheduler.add(held("a1", "A", first=1.0, enqueued=20.0))  # re-enqueued last, at the front
    scheduler.add(held("a2", "A", first=2.0, enqueued=10.0))
    assert ids(scheduler.candidates()) == ["a1"]


def test_an_agent_stays_busy_until_its_job_has_saved_its_cache() -> None:
    scheduler = Scheduler(held_limit=8)
    first, second = held("a1", "A", 1.0), held("a2", "A", 2.0)
    scheduler.add(first)
    scheduler.add(second)
    scheduler.start(first, uid=7)
    assert scheduler.candidates() == []
    scheduler.remove(first)  # finished in the engine, cache not yet saved
    assert scheduler.candidates() == []
    scheduler.agent_done(first)
    assert ids(scheduler.candidates()) == ["a2"]


def test_a_job_waiting_for_the_engine_stops_admission_and_intake() -> None:
    engine = FakeEngine(pool_blocks=4, max_batch=4)  # 4 blocks of 4 tokens
    scheduler = Scheduler(held_limit=8)
    big, small = held("big", None, 1.0, prompt=4, max_tokens=8), held("small", None, 2.0)
    scheduler.add(big)
    scheduler.add(small)
    engine.pool.allocate("busy", 2)  # 2 free: big needs 3, small 2
    offered = [(h.id, verdict.verdict) for h, verdict in scheduler.admissions(engine)]
    assert offered == [("big", "later")]  # small does not overtake it
    assert scheduler.engine_wait == "KV blocks"
    assert not scheduler.wants_more(engine.free_slots())
    engine.pool.free("busy")
    assert [(h.id, v.verdict) for h, v in scheduler.admissions(engine)] == [("big", "now"), ("small", "now")]
    assert scheduler.engine_wait == ""


def test_never_is_offered_and_admission_goes_on() -> None:
    engine = FakeEngine(pool_blocks=2, max_batch=4)
    scheduler = Scheduler(held_limit=8)
    scheduler.add(held("huge", None, 1.0, max_tokens=100))
    scheduler.add(held("fine", None, 2.0))
    verdicts = [(h.id, v) for h, v in scheduler.admissions(engine)]
    assert verdicts == [("huge", Admission("never", "too large")), ("fine", Admission("now"))]


def test_intake_stops_at_the_held_limit_and_when_candidates_fill_the_slots() -> None:
    scheduler = Scheduler(held_limit=3)
    assert scheduler.wants_more(free_slots=2)
    scheduler.add(held("a", None, 1.0))
    scheduler.add(held("b", None, 2.0))
    assert not scheduler.wants_more(free_slots=2)  # two candidates for two slots
    assert scheduler.wants_more(free_slots=3)
    scheduler.add(held("c", "C", 3.0))
    assert not scheduler.wants_more(free_slots=8)  # three held: the limit
