"""Scheduler: which held job enters the engine next.

Waiting jobs form one FIFO deque. A job is admissible when no job of its agent is running
and no earlier waiting job of its agent is ahead of it: an agent's jobs run one at a time,
in order, each resuming from the cache the previous one wrote, while other agents pass by.
Budgets (slots, KV blocks) are the engine's; the loop asks it before each admission.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from worker.held import HeldJob


class Scheduler:
    def __init__(self) -> None:
        self.waiting: deque[HeldJob] = deque()
        self.running: dict[int, HeldJob] = {}
        self._running_agents: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, held: HeldJob) -> None:
        self.waiting.append(held)

    def admissible(self) -> Iterator[HeldJob]:
        """Waiting jobs that may start now, oldest first (a snapshot: safe to admit while iterating)."""
        blocked: set[str] = set(self._running_agents)
        ready: list[HeldJob] = []
        for held in self.waiting:
            agent = held.agent_id
            if agent is None:
                ready.append(held)
            elif agent not in blocked:
                ready.append(held)
                blocked.add(agent)  # later jobs of this agent wait for this one
        return iter(ready)

    def count_admissible(self) -> int:
        return sum(1 for _ in self.admissible())

    def start(self, held: HeldJob, uid: int) -> None:
        self.waiting.remove(held)
        held.uid = uid
        held.phase = "running"
        self.running[uid] = held
        if held.agent_id is not None:
            self._running_agents[held.agent_id] = uid

    def finish(self, uid: int) -> HeldJob | None:
        held = self.running.pop(uid, None)
        if held is not None and held.agent_id is not None:
            self._running_agents.pop(held.agent_id, None)
        return held

    def drop_waiting(self, held: HeldJob) -> None:
        self.waiting.remove(held)

    def by_job_id(self, job_id: str) -> HeldJob | None:
        for held in self.waiting:
            if held.id == job_id:
                return held
        for held in self.running.values():
            if held.id == job_id:
                return held
        return None

    def all(self) -> list[HeldJob]:
        return [*self.waiting, *self.running.values()]
