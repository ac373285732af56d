"""Agent affinity, worker side: say which agents this worker holds hot, and take over affine jobs
that other workers leave waiting.

Producers route an agent's job to `<queue>~<worker>` when the agent's home (the worker whose hot
tier holds its newest cache) is alive (producer/client.py). The home drains that queue before the
shared one. Any other worker takes such a job at once when the home is dead, and after
`affinity_wait` seconds when it is busy or draining: affinity saves a store read, never
availability.
"""

from __future__ import annotations

import time

from redis import Redis
from rq.queue import Queue

from producer.wire.protocol import (
    AGENT_HOME_TTL_S,
    WORKER_QUEUE_SEPARATOR,
    agent_home_key,
    shared_queue_of,
    worker_alive_key,
)
from worker.jobs import rqexec

#: Seconds between looks at other workers' queues (each look is a few Redis round trips).
LOOK_INTERVAL_S = 0.5


class Affinity:
    def __init__(self, connection: Redis, worker: rqexec.KvrqWorker, *, enabled: bool, wait_s: float) -> None:
        self.connection = connection
        self.worker = worker
        self.enabled = enabled
        self.wait_s = wait_s
        self._next_look = 0.0

    def record_home(self, agent_id: str) -> None:
        """This worker's hot tier now holds the agent's newest cache."""
        if self.enabled:
            self.connection.set(agent_home_key(agent_id), self.worker.name, ex=AGENT_HOME_TTL_S)

    def waiting_elsewhere(self) -> list[Queue]:
        """Other workers' own queues whose head job this worker may take now, at most every half second."""
        now = time.monotonic()
        if not self.enabled or now < self._next_look:
            return []
        self._next_look = now + LOOK_INTERVAL_S
        mine = {q.name for q in self.worker.queues}
        shared = [name for name in mine if shared_queue_of(name) == name]
        found = []
        for name in sorted(
            q for s in shared for q in rqexec.worker_queues_of(self.connection, s) if q not in mine
        ):
            queue = Queue(name, connection=self.connection, serializer=self.worker.serializer)
            if not self._home_alive(name) or rqexec.waited_longer(queue, self.wait_s):
                found.append(queue)
        return found

    def _home_alive(self, worker_queue: str) -> bool:
        home = worker_queue.split(WORKER_QUEUE_SEPARATOR, 1)[1]
        return bool(self.connection.exists(worker_alive_key(home)))
