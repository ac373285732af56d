"""Issue 43 item 4: a cache read begun when a job is taken is given a moment (a share of the batch's last
step, once per read) before the batch steps. Before, a read still under way at the step's start cost
its job a whole step: a new agent's store miss, or a disk read, put its first token two steps after its
arrival instead of one. Counted in steps; `wait` is replaced to say whether the read ends in it."""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

import pytest

import worker.loop.admission as loop_module
from engine.core.blocks import AgentCache
from tests.worker.fakes import SPEC
from tests.worker.harness import Harness
from tests.worker.test_warm_join import CountingEngine, SlowReadStore, arrive_during_next_step, busy_batch


def read_result() -> AgentCache:
    return AgentCache(SPEC, [ord(c) for c in "hell"], [])


@pytest.fixture
def setup() -> tuple[Harness, CountingEngine, SlowReadStore]:
    h = Harness(max_batch=8)
    engine = CountingEngine(h.engine)
    store = SlowReadStore(lambda: engine.steps)
    h.store = store
    h.loop = h.new_loop(engine)  # type: ignore[arg-type]
    return h, engine, store


def test_a_read_ending_while_the_batch_waits_is_admitted_before_the_step(
    setup: tuple[Harness, CountingEngine, SlowReadStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    h, engine, store = setup
    waits: list[tuple[int, float]] = []

    def read_ends_in_the_wait(reads: Iterable[Future[Any]], timeout: float) -> None:
        assert timeout == loop_module.READ_WAIT_FRACTION * h.loop.step_s > 0, "a share of the last step"
        waits.append((engine.steps, timeout))
        for read in reads:
            read.set_result(read_result())

    monkeypatch.setattr(loop_module, "wait", read_ends_in_the_wait)
    busy_batch(h, engine, 3)
    arrived, sent = arrive_during_next_step(h, engine, {"agent_id": "b", "prompt": "hello", "max_tokens": 2})
    h.run_until(lambda: bool(sent) and sent[0].status() == "finished")
    assert [steps for steps, _ in waits] == [arrived], "one wait, at the boundary the job was taken at"
    timeline = sent[0].meta()["progress"]["timeline"]
    assert timeline["dequeued_step"] == timeline["cache_ready_step"] == timeline["admitted_step"] == arrived
    assert timeline["first_token_step"] == arrived + 1, "its first token from the very next step"


def test_a_read_outlasting_the_wait_costs_the_batch_one_wait_and_joins_when_it_ends(
    setup: tuple[Harness, CountingEngine, SlowReadStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    h, engine, store = setup
    waits: list[int] = []
    monkeypatch.setattr(loop_module, "wait", lambda reads, timeout: waits.append(engine.steps))
    busy_batch(h, engine, 3)
    arrived, sent = arrive_during_next_step(h, engine, {"agent_id": "b", "prompt": "hello", "max_tokens": 2})
    h.run_until(lambda: bool(store.reads))
    _, read = store.reads[0]
    read_ends = arrived + 3
    engine.during[read_ends] = lambda: read.set_result(read_result())
    h.run_until(lambda: bool(sent) and sent[0].status() == "finished")
    assert waits == [arrived], "waited for once, not at every step while it was under way"
    timeline = sent[0].meta()["progress"]["timeline"]
    assert timeline["admitted_step"] == read_ends, "inserted at the first boundary after its read ended"


def test_a_read_that_ended_during_the_rest_of_the_intake_is_admitted_before_the_step(
    setup: tuple[Harness, CountingEngine, SlowReadStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The read was under way when the job was offered to the engine, and over (nothing left to wait
    for) by the time the batch is about to step: found through the worker's own bench, where a store
    miss ended during the intake's next dequeue and the job lost a step."""
    h, engine, store = setup
    monkeypatch.setattr(loop_module, "wait", lambda reads, timeout: pytest.fail("nothing to wait for"))
    busy_batch(h, engine, 3)
    real_steal = h.loop.intake.steal

    def reads_end_meanwhile() -> Any:
        for _, read in store.reads:
            if not read.done():
                read.set_result(read_result())
        return real_steal()

    monkeypatch.setattr(h.loop.intake, "steal", reads_end_meanwhile)
    arrived, sent = arrive_during_next_step(h, engine, {"agent_id": "b", "prompt": "hello", "max_tokens": 2})
    h.run_until(lambda: bool(sent) and sent[0].status() == "finished")
    timeline = sent[0].meta()["progress"]["timeline"]
    assert timeline["dequeued_step"] == timeline["admitted_step"] == arrived
    assert timeline["first_token_step"] == arrived + 1
