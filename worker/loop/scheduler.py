"""Scheduler: the held jobs of this worker and the policy that decides which enters the engine next.

Held jobs are `waiting` (a FIFO deque) or `running` (by engine uid). The policy:
- an agent's jobs run one at a time, in order: a job is a candidate only while no earlier
  job of its agent is held here and none is running or still saving its cache;
- candidates are offered oldest first, each with the engine's verdict at that moment
  (`engine.admission`): "never" ends the job, "later" (no slot, no KV blocks) stops the
  pass so nothing overtakes it and a large job cannot starve;
- the worker dequeues more only while it holds fewer than `held_limit` jobs, nothing waits
  for the engine, and the engine has more free slots than there are candidates.

No I/O here: the loop does Redis and the store, so the policy is testable with a fake engine.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Protocol

from engine.core.admission import Admission
from worker.loop.held import HeldJob


class AdmissionOracle(Protocol):
    def admission(self, n_prompt_tokens: int, max_tokens: int) -> Admission: ...

    def free_slots(self) -> int: ...


class Scheduler:
    def __init__(self, held_limit: int) -> None:
        self.held_limit = held_limit
        self.waiting: deque[HeldJob] = deque()
        self.running: dict[int, HeldJob] = {}
        self.engine_wait = ""  # why the oldest candidate waits for the engine ("" when none does)
        self._busy_agents: dict[str, str] = {}  # agent -> job id running here or still saving its cache

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    def __bool__(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, held: HeldJob) -> None:
        self.waiting.append(held)

    def candidates(self) -> list[HeldJob]:
        """Waiting jobs whose agent's turn it is on this worker, oldest first.

        Per agent, only its earliest job by first enqueue time: a job re-queued after a
        crash may be taken after the agent's later jobs and must still run first.
        """
        earliest: dict[str, HeldJob] = {}
        for held in self.waiting:
            agent = held.agent_id
            if agent is None or agent in self._busy_agents:
                continue
            first = earliest.get(agent)
            if first is None or held.first_enqueued_at < first.first_enqueued_at:
                earliest[agent] = held
        return [
            held
            for held in self.waiting
            if not held.cancel_requested and (held.agent_id is None or earliest.get(held.agent_id) is held)
        ]

    def admissions(self, engine: AdmissionOracle) -> Iterator[tuple[HeldJob, Admission]]:
        """Candidates with the engine's verdict, asked lazily so each sees the previous submits.

        Stops after the first "later": that job waits for running ones to end, and nothing
        behind it is offered (the caller records `engine_wait` from its reason).
        """
        self.engine_wait = ""
        for held in self.candidates():
            verdict = engine.admission(len(held.prompt_tokens), held.sampling.max_tokens)
            if verdict.verdict == "later":
                self.engine_wait = verdict.reason
            yield held, verdict
            if verdict.verdict == "later":
                return

    def wants_more(self, free_slots: int) -> bool:
        """Whether to dequeue another job now."""
        return len(self) < self.held_limit and not self.engine_wait and free_slots > len(self.candidates())

    def start(self, held: HeldJob, uid: int) -> None:
        self.waiting.remove(held)
        held.uid = uid
        held.phase = "running"
        self.running[uid] = held
        if held.agent_id is not None:
            self._busy_agents[held.agent_id] = held.id

    def remove(self, held: HeldJob) -> None:
        """Take `held` out of waiting or running; its agent stays busy until `agent_done`."""
        if held.uid is not None and self.running.get(held.uid) is held:
            del self.running[held.uid]
        elif held in self.waiting:
            self.waiting.remove(held)

    def agent_done(self, held: HeldJob) -> None:
        """`held` no longer blocks its agent here (ended, and its cache is in the store)."""
        if held.agent_id is not None and self._busy_agents.get(held.agent_id) == held.id:
            del self._busy_agents[held.agent_id]

    def by_uid(self, uid: int) -> HeldJob | None:
        return self.running.get(uid)

    def by_job_id(self, job_id: str) -> HeldJob | None:
        return next((held for held in self.all() if held.id == job_id), None)

    def all(self) -> list[HeldJob]:
        return [*self.waiting, *self.running.values()]
