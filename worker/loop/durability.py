"""One owner for "is this agent's cache durable yet?": the store puts of ended turns, and the agent
locks they keep until then.

An agent's lock is released only once its job's cache put is durable in the shared store (or has
failed), so the agent's next job, on any worker, resumes from it (worker/fleet/agent_turns.py). The
store's put is a Future (write-behind); this is the only place that holds those Futures.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future

from worker.fleet.agent_turns import AgentTurns
from worker.loop.held import HeldJob

log = logging.getLogger("kvrq.worker")


class Durability:
    def __init__(self, turns: AgentTurns, counts: dict[str, int]) -> None:
        self.turns = turns
        self.counts = counts
        self.saving: list[tuple[HeldJob, Future[bool]]] = []  # agent turns kept until the put is durable

    def track(self, held: HeldJob, put: Future[bool]) -> None:
        """`held`'s agent lock waits for `put`."""
        self.saving.append((held, put))

    def pending(self, held: HeldJob) -> bool:
        """Whether `held`'s cache put is still under way (its lock is released later, by `release`)."""
        return any(saving is held for saving, _ in self.saving)

    def release(self, force: bool = False) -> None:
        """Free the agent locks of jobs whose cache is now durable (or whose put failed); `force`: all
        of them (at shutdown, once the store is closed)."""
        still: list[tuple[HeldJob, Future[bool]]] = []
        for held, put in self.saving:
            if not put.done() and not force:
                still.append((held, put))
                continue
            try:
                if put.done() and put.result() is False:
                    self.counts["stale_puts"] += 1
            except Exception as exc:
                log.warning("job %s: agent %s's cache was not saved: %s", held.id, held.agent_id, exc)
                self.counts["cache_put_failed"] += 1
            assert held.agent_id is not None
            self.turns.release(held.agent_id, held.id)
        self.saving = still
