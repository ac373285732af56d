"""Which batch line may be enqueued next: file order, one job at a time per agent.

An agent's line k+1 becomes ready only when its line k has ended, so turn 2 resumes from the cache turn 1
saved and an agent's lines run in file order; lines without an agent, and lines of different agents, are
independent and run concurrently. Among ready lines the earliest in the file goes first.
"""

from __future__ import annotations

import heapq
from collections import deque

from producer.batch.format import BatchRequest


def lane_of(item: BatchRequest) -> str:
    return f"agent:{item.agent_id}" if item.agent_id is not None else f"line:{item.line}"


class Lanes:
    """Pending lines grouped by agent, with a heap of the lines ready to go."""

    def __init__(self) -> None:
        self._pending: dict[str, deque[BatchRequest]] = {}
        self._busy: dict[str, int] = {}
        self._ready: list[tuple[int, str]] = []
        self._in_ready: set[str] = set()
        self._started = False

    def add(self, item: BatchRequest) -> None:
        """Queue a line behind the earlier lines of its agent (call in file order)."""
        self._pending.setdefault(lane_of(item), deque()).append(item)
        if self._started:
            self._push_if_ready(lane_of(item))

    def hold(self, item: BatchRequest) -> None:
        """A line already has a job (found on resume): its agent waits for it."""
        lane = lane_of(item)
        self._busy[lane] = self._busy.get(lane, 0) + 1

    def start(self) -> None:
        self._started = True
        for lane in self._pending:
            self._push_if_ready(lane)

    def _push_if_ready(self, lane: str) -> None:
        queue = self._pending.get(lane)
        if queue and not self._busy.get(lane) and lane not in self._in_ready:
            heapq.heappush(self._ready, (queue[0].line, lane))
            self._in_ready.add(lane)

    def pop_ready(self) -> BatchRequest | None:
        """The earliest ready line; its agent is busy until `release`."""
        if not self._started:
            self.start()
        if not self._ready:
            return None
        _, lane = heapq.heappop(self._ready)
        self._in_ready.discard(lane)
        item = self._pending[lane].popleft()
        if not self._pending[lane]:
            del self._pending[lane]
        self._busy[lane] = self._busy.get(lane, 0) + 1
        return item

    def release(self, item: BatchRequest) -> None:
        """The line's job ended: its agent's next line becomes ready."""
        lane = lane_of(item)
        left = self._busy.get(lane, 0) - 1
        if left > 0:
            self._busy[lane] = left
            return
        self._busy.pop(lane, None)
        self._push_if_ready(lane)

    def pending(self) -> int:
        return sum(len(queue) for queue in self._pending.values())

    def ready(self) -> int:
        return len(self._ready)
