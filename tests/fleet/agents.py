"""Agents talking to a fleet while it is struck (rolling restarts, a queue failover), and the checks.

Each agent runs in its own thread, one turn after another (its history, the answer and a new question),
until told to stop, then takes `final_turns` more: the turns that must resume after the strike. Every
enqueue carries its own job id, so a submit that raised (a failover outlasting the producer's budget)
is sent again as the same job: at most one job per turn. Afterwards the checks say, per job, whether it
ran once (tests/worker/chaos_checks), per turn whether it resumed from at least its previous prompt,
and per agent whether the conversation record holds each turn once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from producer.client import JobHandle, Producer
from producer.conversation import read_record
from producer.models import GenerationResult
from producer.wire.protocol import CACHE_HITS_FIELD, CACHE_LOOKUPS_FIELD
from tests.worker.chaos_checks import deliveries, summary
from tests.worker.procs import WorkerProcess
from tests.worker.reference import reference_results

# Over one 256-token block, so a resumed turn reuses whole blocks from the store, not only a hot tier.
SYSTEM = "You are the radio operator of a small coaster. " + " ".join(
    f"Standing order {i}: log every call, answer in a few plain words, never guess a position."
    for i in range(1, 15)
)
QUESTIONS = ("Name a color.", "Name a fruit.", "Name a port.", "Name a fish.", "Name a tool.", "Name a tree.")
MAX_TOKENS = 4
RESULT_TIMEOUT_S = 300
RESUBMIT_FOR_S = 120


@dataclass
class Turn:
    agent: str
    number: int  # 1, 2, ... per agent
    request: dict[str, Any]
    handle: JobHandle
    result: GenerationResult
    resubmits: int  # submits that raised before one was acknowledged
    submitted: float  # time.monotonic() of the first submit
    ended: float  # time.monotonic() once its result was read


class AgentLoad:
    """`agents` agents in threads against `producer`, from `start()` until `finish()`."""

    def __init__(self, producer: Producer, agents: list[str], *, final_turns: int = 1) -> None:
        self.producer = producer
        self.agents = agents
        self.final_turns = final_turns
        self.turns: dict[str, list[Turn]] = {agent: [] for agent in agents}
        self.history = {agent: [{"role": "system", "content": SYSTEM}] for agent in agents}
        self.errors: list[str] = []
        self._stopping = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(a,), daemon=True) for a in agents]

    def start(self) -> AgentLoad:
        for thread in self._threads:
            thread.start()
        return self

    def finished_turns(self) -> int:
        return sum(len(turns) for turns in self.turns.values())

    def wait_for_turns(self, more: int, timeout: float = RESULT_TIMEOUT_S) -> None:
        """Until `more` turns finished from now on (the load is really running), or fail."""
        target = self.finished_turns() + more
        deadline = time.monotonic() + timeout
        while self.finished_turns() < target:
            assert not self.errors, self.errors
            assert time.monotonic() < deadline, f"fewer than {more} turns finished in {timeout:.0f} s"
            time.sleep(0.1)

    def finish(self, timeout: float = 2 * RESULT_TIMEOUT_S) -> None:
        """Stop: every agent takes `final_turns` more turns, then its thread ends."""
        self._stopping.set()
        for thread in self._threads:
            thread.join(timeout)
        assert not any(thread.is_alive() for thread in self._threads), "an agent never finished its turns"
        assert not self.errors, self.errors

    def _run(self, agent: str) -> None:
        try:
            while not self._stopping.is_set():
                self._turn(agent)
            for _ in range(self.final_turns):
                self._turn(agent)
        except Exception as exc:  # reported by the main thread
            self.errors.append(f"{agent}: {exc!r}")

    def _turn(self, agent: str) -> None:
        number = len(self.turns[agent]) + 1
        question = {"role": "user", "content": QUESTIONS[(number + len(agent)) % len(QUESTIONS)]}
        messages = [*self.history[agent], question]
        request: dict[str, Any] = {"agent_id": agent, "messages": messages, "max_tokens": MAX_TOKENS}
        job_id = f"{agent}-turn-{number}"
        submitted = time.monotonic()
        handle, resubmits = self._submit(request, job_id)
        result = handle.result(timeout=RESULT_TIMEOUT_S)
        self.history[agent] = [*messages, {"role": "assistant", "content": result.text}]
        self.turns[agent].append(
            Turn(agent, number, request, handle, result, resubmits, submitted, time.monotonic())
        )

    def _submit(self, request: dict[str, Any], job_id: str) -> tuple[JobHandle, int]:
        """Submit until acknowledged; the same job id each time (a second submit never makes a second job)."""
        deadline = time.monotonic() + RESUBMIT_FOR_S
        resubmits = 0
        while True:
            try:
                return self.producer.submit(request, job_id=job_id), resubmits
            except RedisConnectionError:
                if time.monotonic() > deadline:
                    raise
                resubmits += 1
                time.sleep(0.5)

    # ---- checks ----------------------------------------------------------------------------

    def all_turns(self) -> list[Turn]:
        return [turn for agent in self.agents for turn in self.turns[agent]]

    def delivery(self) -> dict[str, int]:
        """finished / failed / lost / duplicated ... over every job of every turn."""
        return summary(deliveries([turn.handle for turn in self.all_turns()]))

    def misses(self) -> list[tuple[str, int, int, int]]:
        """(agent, turn, reused, previous prompt) for each later turn that reused less than its previous
        turn's whole prompt (a prefix of this one): the turns that missed their cache."""
        found = []
        for agent in self.agents:
            turns = self.turns[agent]
            for before, turn in zip(turns, turns[1:], strict=False):
                reused, previous = turn.result.usage.reused_tokens, before.result.usage.prompt_tokens
                if reused < previous:
                    found.append((agent, turn.number, reused, previous))
        return found

    def records_out_of_step(self) -> dict[str, str]:
        """agent -> what is wrong with its conversation record: it must be exactly the agent's history
        (each turn once, none lost or doubled) as written by its last turn's job."""
        wrong = {}
        for agent in self.agents:
            record = read_record(self.producer.connection, agent)
            last = self.turns[agent][-1]
            if record is None:
                wrong[agent] = "no record"
                continue
            messages = [{"role": m.role, "content": m.content} for m in record.messages]
            if messages != self.history[agent]:
                wrong[agent] = f"{len(messages)} messages, history has {len(self.history[agent])}"
            elif record.job_id != last.handle.id:
                wrong[agent] = f"written by {record.job_id}, last turn was {last.handle.id}"
        return wrong


def wrong_answers(turns: list[Turn]) -> list[tuple[str, int]]:
    """(agent, turn) of each of `turns` whose answer differs from the same history run alone, without
    any cache, greedy: a turn that paired its messages with another turn's cache answers differently."""
    expected = reference_results([turn.request for turn in turns])
    return [
        (turn.agent, turn.number)
        for turn, want in zip(turns, expected, strict=True)
        if (turn.result.text, turn.result.token_ids) != (want["text"], want["token_ids"])
    ]


def counted_misses(connection: Redis, workers: Sequence[WorkerProcess]) -> int:
    """Agent cache lookups that found nothing, over `workers` (their heartbeat's counters)."""
    total = 0
    for worker in workers:
        fields: Any = connection.hgetall(f"rq:worker:{worker.name}")
        lookups = int(fields.get(CACHE_LOOKUPS_FIELD.encode(), 0))
        total += lookups - int(fields.get(CACHE_HITS_FIELD.encode(), 0))
    return total
