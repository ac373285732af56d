"""Who listens on a queue: so a client that waits long can say what it waits for.

A job in a queue no live worker listens on waits forever without a sound; `kvrq generate`,
`kvrq batch run` and `JobHandle.result()` use these helpers to say so after a few seconds.
A worker counts as live while its rq worker key exists (rq lets it expire when heartbeats stop)
and, for a kvrq worker (its hash has CAPACITY_FIELD), while its liveness key exists too: that
one is gone seconds after a `kill -9`, the rq key only minutes later.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from redis import Redis
from rq import Queue, Worker
from rq.job import Job, JobStatus
from rq.worker import BaseWorker

from producer.wire.protocol import CAPACITY_FIELD, SERIALIZER, worker_alive_key
from producer.wire.text import as_text

#: Seconds of waiting before a client first says that no worker listens, then how often it repeats it.
FIRST_NOTICE_S = 5.0
REPEAT_NOTICE_S = 30.0


def live_workers(connection: Redis, queue: str) -> list[BaseWorker]:
    """The workers registered for `queue` that are alive (JSON serializer, as kvrq's)."""
    registered = Worker.all(
        queue=Queue(queue, connection=connection, serializer=SERIALIZER), serializer=SERIALIZER
    )
    return alive(connection, registered)


def all_live_workers(connection: Redis) -> list[BaseWorker]:
    """Every registered worker that is alive, whatever its queues."""
    return alive(connection, Worker.all(connection=connection, serializer=SERIALIZER))


def alive(connection: Redis, registered: list[BaseWorker]) -> list[BaseWorker]:
    """The workers of `registered` that are alive: a kvrq worker needs its liveness key too."""
    if not registered:
        return []
    with connection.pipeline(transaction=False) as pipe:
        for worker in registered:
            pipe.hexists(worker.key, CAPACITY_FIELD)
            pipe.exists(worker_alive_key(worker.name))
        flags = pipe.execute()
    return [w for i, w in enumerate(registered) if not flags[2 * i] or flags[2 * i + 1]]


def no_worker_line(queue: str) -> str:
    return f"no live worker listens on queue '{queue}': jobs there wait until one starts"


def unheard_queue(connection: Redis, job_id: str) -> str | None:
    """The job's queue when the job waits there and no live worker listens on it, else None."""
    status, queue, _ = _job_fields(connection, job_id)
    if status != JobStatus.QUEUED or not queue or live_workers(connection, queue):
        return None
    return queue


def job_wait_detail(connection: Redis, job_id: str) -> str:
    """Where a job that has not ended stands, in words: queued (behind how many, with how many
    workers listening), or started (on which worker)."""
    status, queue, worker = _job_fields(connection, job_id)
    if status is None:
        return f"job {job_id} is no longer in Redis"
    if status == JobStatus.STARTED:
        return f"job {job_id} is running on worker {worker or '?'}"
    if status != JobStatus.QUEUED or not queue:
        return f"job {job_id} is {status}"
    workers = len(live_workers(connection, queue))
    if workers == 0:
        return f"job {job_id} is still queued: {no_worker_line(queue)}"
    ahead = connection.lpos(Queue(queue, connection=connection).key, job_id)
    position = "" if ahead is None else f" behind {ahead} job(s)"
    return f"job {job_id} is still queued{position}; {workers} live worker(s) listen on queue '{queue}'"


class WorkerWatch:
    """Says (through `say`) that no live worker listens on `queue` once a wait has lasted `first_s`
    without progress, then again every `repeat_s` while that stays true.

    Call `check()` as often as the wait loop turns (it reads Redis only when a notice is due) and
    `progressed()` when something the wait was for happened (a job ended), which restarts the clock.
    """

    def __init__(
        self,
        connection: Redis,
        queue: str,
        say: Callable[[str], None],
        *,
        first_s: float | None = None,
        repeat_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.connection = connection
        self.queue = queue
        self.say = say
        self.first_s = FIRST_NOTICE_S if first_s is None else first_s
        self.repeat_s = REPEAT_NOTICE_S if repeat_s is None else repeat_s
        self.clock = clock
        self.notices = 0
        self._due = clock() + self.first_s

    def progressed(self) -> None:
        self._due = self.clock() + self.first_s

    def check(self) -> bool:
        """Say the notice if one is due and no live worker listens; returns whether it said it."""
        now = self.clock()
        if now < self._due:
            return False
        if live_workers(self.connection, self.queue):
            self._due = now + self.first_s  # look again soon: the worker may die
            return False
        self._due = now + self.repeat_s
        self.notices += 1
        self.say(no_worker_line(self.queue))
        return True


def _job_fields(connection: Redis, job_id: str) -> tuple[str | None, str | None, str | None]:
    """(status, origin queue, worker name) from the rq job hash; None where absent."""
    raw: list[bytes | str | None] = connection.hmget(Job.key_for(job_id), ["status", "origin", "worker_name"])
    status, queue, worker = (as_text(value) for value in raw)
    return status, queue, worker
