"""Abandoned-job cleanup: what makes a `kill -9` lose no job.

A started job whose heartbeat has expired belongs to a worker that died. rq's
StartedJobRegistry cleanup re-queues it while it has retries left (`job.retry()`) and
fails it with AbandonedJobError otherwise. Workers run this at start and periodically;
`kvrq maintenance` runs it on demand. A job stranded between dequeue and start (in rq's
intermediate queue for over a minute) was never started: it goes back on its queue.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from redis import Redis
from rq import worker_registration
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.registry import clean_registries

from producer.protocol import SERIALIZER

log = logging.getLogger("kvrq.maintenance")


@dataclass
class MaintenanceReport:
    abandoned: dict[str, list[str]] = field(default_factory=dict)  # queue -> job ids handled as abandoned
    rescued: dict[str, list[str]] = field(default_factory=dict)  # queue -> job ids put back from intermediate
    skipped: list[str] = field(default_factory=list)  # queues another process was cleaning

    @property
    def total_abandoned(self) -> int:
        return sum(len(ids) for ids in self.abandoned.values())


def clean_queues(connection: Redis, queue_names: list[str], *, now: float | None = None) -> MaintenanceReport:
    """Run the cleanup on each queue, under rq's per-queue maintenance lock.

    `now` (unix time) treats heartbeats older than it as expired (tests, and an operator
    who knows a worker is gone, can pass a later time).
    """
    report = MaintenanceReport()
    for name in queue_names:
        queue = Queue(name, connection=connection, serializer=SERIALIZER)
        if not queue.acquire_maintenance_lock():
            report.skipped.append(name)
            continue
        try:
            started = queue.started_job_registry
            expired = [
                job_id
                for job_id in started.get_expired_job_ids(now)
                if _status(connection, job_id) == "started"
            ]
            if now is not None:
                started.cleanup(timestamp=now)
            clean_registries(queue)
            worker_registration.clean_worker_registry(queue)
            report.abandoned[name] = expired
            report.rescued[name] = _rescue_intermediate(queue)
        finally:
            queue.release_maintenance_lock()
        if expired:
            log.warning("queue %s: %d abandoned job(s) re-queued or failed: %s", name, len(expired), expired)
    return report


def _status(connection: Redis, job_id: str) -> str | None:
    raw = connection.hget(Job.key_for(job_id), "status")
    return raw.decode() if isinstance(raw, bytes) else raw


def _rescue_intermediate(queue: Queue) -> list[str]:
    intermediate = queue.intermediate_queue
    started = set(queue.started_job_registry.get_job_ids(cleanup=False))
    rescued = []
    for job_id in intermediate.get_job_ids():
        if job_id in started:
            continue
        if intermediate.set_first_seen(job_id) or not intermediate.should_be_cleaned_up(job_id):
            continue  # give the worker that dequeued it a minute to start it
        intermediate.remove(job_id)
        if _status(queue.connection, job_id) == JobStatus.QUEUED:
            queue.push_job_id(job_id, at_front=True)
            rescued.append(job_id)
    if rescued:
        log.warning(
            "queue %s: %d job(s) stranded after dequeue put back: %s", queue.name, len(rescued), rescued
        )
    return rescued
