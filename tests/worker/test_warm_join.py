"""A warm agent joining a busy batch, counted in engine steps (issue 28, item 5): a job that arrives
while a step runs is taken and inserted at the very next step boundary with its cache loaded, and
its first token comes out of the next step, together with every batch mate's token (its suffix rides
in the same forward). Steps are counted, not timed: bench_worker.py --warm-join gives the times."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import pytest

from engine.batch.engine import BlockPoolBatchEngine
from engine.core.blocks import AgentCache
from engine.core.results import StepOutput
from producer.client import JobHandle
from tests.engine.tiny import ByteTokenizer, tiny_model
from tests.worker.fakes import SPEC, DictStore
from tests.worker.harness import Harness

HISTORY = "The fleet has eleven boats, each named after a seabird; four sail in winter. " * 4


class CountingEngine:
    """An engine with its steps counted: `during[n]` runs inside step n (a job arriving mid-step)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.steps = 0
        self.during: dict[int, Callable[[], None]] = {}
        self.submits: list[
            tuple[int, str | None, AgentCache | None, int]
        ] = []  # steps run, agent, cache, uid
        self.outputs: dict[int, set[int]] = {}  # step -> uids that got a token in it

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def submit(self, agent_id: str | None, *args: Any, **kwargs: Any) -> int:
        uid = int(self.inner.submit(agent_id, *args, **kwargs))
        self.submits.append((self.steps, agent_id, kwargs.get("cache"), uid))
        return uid

    def step(self) -> StepOutput:
        self.steps += 1
        arriving = self.during.pop(self.steps, None)
        if arriving is not None:
            arriving()
        output: StepOutput = self.inner.step()
        self.outputs[self.steps] = {delta.uid for delta in output.deltas}
        return output


def busy_batch(h: Harness, engine: CountingEngine, mates: int) -> list[JobHandle]:
    """`mates` long jobs, run until every one of them is decoding."""
    handles = [
        h.producer.submit({"prompt": f"mate {i}: tell a story", "max_tokens": 60}) for i in range(mates)
    ]
    h.run_until(
        lambda: (
            len(h.loop.scheduler.running) == mates
            and all(held.generated >= 2 for held in h.loop.scheduler.running.values())
        )
    )
    return handles


def arrive_during_next_step(
    h: Harness, engine: CountingEngine, request: dict[str, Any]
) -> tuple[int, list[JobHandle]]:
    """Enqueue `request` from inside the engine's next step; (that step's number, [its handle] once sent)."""
    step = engine.steps + 1
    sent: list[JobHandle] = []
    engine.during[step] = lambda: sent.append(h.producer.submit(request))
    return step, sent


def the_submit_of(engine: CountingEngine, agent: str, nth: int) -> tuple[int, AgentCache | None, int]:
    steps, _, cache, uid = [s for s in engine.submits if s[1] == agent][nth]
    return steps, cache, uid


@pytest.fixture
def tiny() -> Iterator[tuple[Harness, CountingEngine]]:
    inner = BlockPoolBatchEngine(
        tiny_model("llama"),
        ByteTokenizer(),
        model_name="tiny-llama",
        pool_blocks=64,
        max_batch=8,
        max_context=4096,
    )
    h = Harness(max_batch=8)
    engine = CountingEngine(inner)
    h.loop = h.new_loop(engine)  # type: ignore[arg-type]
    yield h, engine
    inner.close()


def test_a_warm_job_arriving_mid_step_joins_at_the_next_boundary_and_its_first_token_rides_the_next_step(
    tiny: tuple[Harness, CountingEngine],
) -> None:
    h, engine = tiny
    turn1 = h.producer.submit({"agent_id": "a", "prompt": HISTORY, "max_tokens": 2})
    h.run_until(h.all_ended([turn1]))
    assert "a" in h.store.caches
    mates = busy_batch(h, engine, 4)
    mate_uids = set(h.loop.scheduler.running)

    arrived, sent = arrive_during_next_step(
        h, engine, {"agent_id": "a", "prompt": HISTORY + " And in winter?", "max_tokens": 3}
    )
    h.run_until(lambda: bool(sent) and sent[0].status() == "finished")

    submitted_after, cache, uid = the_submit_of(engine, "a", 1)
    assert submitted_after == arrived, "inserted at the first step boundary after it arrived"
    assert cache is not None, "its saved cache went into the engine with it"
    result = sent[0].result(timeout=1)
    assert result.usage.reused_tokens >= len(HISTORY) - 1
    assert 1 <= result.usage.prefilled_tokens <= len(" And in winter?"), "a warm suffix, not a cold prompt"
    first_token_step = min(step for step, uids in engine.outputs.items() if uid in uids)
    assert first_token_step == arrived + 1, "the warm suffix took no step of its own"
    assert mate_uids <= engine.outputs[first_token_step], "the batch mates decoded in the same step"
    timeline = sent[0].meta()["progress"]["timeline"]
    assert timeline["dequeued_step"] == timeline["cache_ready_step"] == timeline["admitted_step"] == arrived
    assert timeline["first_token_step"] == arrived + 1
    assert (
        timeline["step_cpu"] > 0 and timeline["step_before_cpu"] > 0
    )  # the join step's cost, and a busy one's
    assert timeline["enqueued"] <= timeline["dequeued"] <= timeline["admitted"] <= timeline["first_token"]
    for handle in mates:
        handle.cancel()


class SlowReadStore(DictStore):
    """Agent reads that stay in flight until the test completes them (a store read off the step thread)."""

    def __init__(self, steps_run: Callable[[], int]) -> None:
        super().__init__()
        self.steps_run = steps_run
        self.reads: list[tuple[int, Future[AgentCache | None]]] = []  # (engine steps run when it began, read)

    def read(self, agent_id: str) -> Future[AgentCache | None]:
        read: Future[AgentCache | None] = Future()
        self.reads.append((self.steps_run(), read))
        return read


def test_a_job_whose_cache_read_ends_mid_step_is_inserted_at_the_boundary_right_after() -> None:
    h = Harness(max_batch=8)
    engine = CountingEngine(h.engine)
    store = SlowReadStore(lambda: engine.steps)
    h.store = store
    h.loop = h.new_loop(engine)  # type: ignore[arg-type]
    busy_batch(h, engine, 3)
    arrived, sent = arrive_during_next_step(h, engine, {"agent_id": "b", "prompt": "hello", "max_tokens": 2})
    h.run_until(lambda: bool(store.reads))
    began, read = store.reads[0]
    assert began == arrived, "taken at the next boundary, its read started there"
    read_ends = arrived + 2
    engine.during[read_ends] = lambda: read.set_result(AgentCache(SPEC, [ord(c) for c in "hell"], []))
    h.run_until(lambda: bool(sent) and sent[0].status() == "finished")
    submitted_after, cache, _ = the_submit_of(engine, "b", 0)
    assert cache is not None
    assert submitted_after == read_ends, "inserted at the first boundary after its read ended, no later"
