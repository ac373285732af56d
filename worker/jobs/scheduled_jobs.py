"""rq's scheduler run by the engine loop: `enqueue_at` / `enqueue_in` and `Retry(interval=...)`
jobs reach their queue on time with kvrq workers alone.

rq's own worker forks a scheduler process. A kvrq worker does not fork: the process holds
MLX, OpenBLAS and the store's I/O threads (a fork copies their locks mid-use) and gigabytes of
weights; and the scheduler's work is one ZRANGEBYSCORE per queue. So the loop drives rq's
`RQScheduler` itself every `scheduler_interval` seconds (public calls only): the same per-queue
lock (`rq:scheduler-lock:<queue>`, one holder across the fleet, plain `rq worker
--with-scheduler` included), the same ScheduledJobRegistry, the same enqueue. A step delays a
scheduled job by at most one step; the lock lives 60 s past the interval, far beyond any step.
A worker that stops releases its locks, and every worker tries the free ones at each run, so
another one takes over within a second or so (rq's own workers retry only every 2 minutes).
"""

from __future__ import annotations

import logging
import time

from redis import Redis
from rq.scheduler import RQScheduler

from producer.wire.protocol import SERIALIZER

log = logging.getLogger("kvrq.worker")


class ScheduledJobs:
    """One worker's share of rq's scheduling: the queues whose scheduler lock it holds."""

    def __init__(self, connection: Redis, queue_names: list[str], worker_name: str, interval: float) -> None:
        self.interval = interval
        self.next_run = 0.0
        self.scheduler = RQScheduler(
            queue_names,
            connection=connection,
            interval=max(1, round(interval)),  # rq's lock lives interval + 60 s
            serializer=SERIALIZER,
            name=worker_name,
        )
        self._wanted = set(queue_names)
        self._born = False

    @property
    def locked_queues(self) -> set[str]:
        return set(self.scheduler.acquired_locks)

    def due(self, now: float) -> bool:
        return self.interval > 0 and now >= self.next_run

    def run(self, now: float | None = None) -> None:
        """Take free locks, refresh held ones, move due jobs from each locked queue's ScheduledJobRegistry."""
        scheduler = self.scheduler
        if not self._born:
            scheduler.register_birth()
            self._born = True
        if self.locked_queues != self._wanted:
            scheduler.acquire_locks()  # takes free locks (rq logs it), refreshes ours: one script call each
        else:
            scheduler.heartbeat()
        if scheduler.acquired_locks:
            scheduler.enqueue_scheduled_jobs()
        self.next_run = (time.monotonic() if now is None else now) + self.interval

    def stop(self) -> None:
        """Release the locks (another worker takes them at its next run) and the scheduler's record."""
        if self.locked_queues:
            log.info("releasing the scheduler lock of %s", sorted(self.locked_queues))
        self.scheduler.release_locks()
        if self._born:
            self.scheduler.register_death()
