"""Crash re-runs and abandoned-job cleanup: what makes a `kill -9` lose no job.

A started job whose kvrq worker has no liveness key any more (worker/fleet/liveness.py: gone
within seconds of a `kill -9`), or whose execution heartbeat expired (a worker stuck for
minutes), is re-queued at the front of its queue and runs again, from a crash budget of
its own (default 2 re-runs, separate from `retries`); past it, it fails with
ErrorCode.WORKER_CRASHED. The dead worker's agent locks and rq record go with it. Every
live worker runs this every few seconds (`crash_check_interval`), `kvrq maintenance` on
demand. Then rq's own registry cleanup runs, and a job stranded between dequeue and start
(in rq's intermediate queue for over a minute) was never started: it goes back on its queue.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from redis import Redis
from rq import worker_registration
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.registry import clean_registries

from producer.wire.protocol import CAPACITY_FIELD, SERIALIZER, shared_queue_of
from worker.fleet.agent_turns import release_dead_worker
from worker.fleet.liveness import alive
from worker.jobs import rqexec

#: Crash re-runs a job gets when neither it nor the worker says otherwise.
DEFAULT_CRASH_RERUNS = 2
_CRASH_LOCK_MS = 10_000

log = logging.getLogger("kvrq.maintenance")


@dataclass
class MaintenanceReport:
    rerun: dict[str, list[str]] = field(default_factory=dict)  # queue -> job ids re-queued after a crash
    crashed: dict[str, list[str]] = field(default_factory=dict)  # queue -> job ids failed: crash budget spent
    dead_workers: list[str] = field(default_factory=list)
    abandoned: dict[str, list[str]] = field(default_factory=dict)  # queue -> job ids handled as abandoned
    rescued: dict[str, list[str]] = field(default_factory=dict)  # queue -> job ids put back from intermediate
    skipped: list[str] = field(default_factory=list)  # queues another process was cleaning


def rerun_crashed(
    connection: Redis,
    queue_names: list[str],
    *,
    now: float | None = None,
    crash_reruns: int = DEFAULT_CRASH_RERUNS,
    report: MaintenanceReport | None = None,
) -> MaintenanceReport:
    """Re-run (or fail, past their crash budget) the started jobs of workers that died.

    Cheap when nothing died (one ZRANGE per queue and one EXISTS per worker holding jobs), so
    every worker runs it every few seconds; a short lock per queue keeps two from racing.
    """
    report = report or MaintenanceReport()
    at = time.time() if now is None else now
    dead: set[str] = set()
    shared = sorted({shared_queue_of(name) for name in queue_names})
    checked = sorted({*shared, *(q for name in shared for q in rqexec.worker_queues_of(connection, name))})
    for name in checked:
        queue = Queue(name, connection=connection, serializer=SERIALIZER)
        lock = f"kvrq:crash-check:{name}"
        if not connection.set(lock, "1", nx=True, px=_CRASH_LOCK_MS):
            continue
        try:
            executions = rqexec.started_executions(queue)
            workers = sorted({e.worker_name for e in executions if e.worker_name})
            living = alive(connection, workers)
            for execution in executions:
                why = _why_dead(connection, queue, execution, living, at)
                if why is None:
                    continue
                outcome = rqexec.rerun_after_crash(queue, execution, default_budget=crash_reruns, why=why)
                if outcome == "requeued":
                    report.rerun.setdefault(shared_queue_of(name), []).append(execution.job_id)
                elif outcome == "failed":
                    report.crashed.setdefault(shared_queue_of(name), []).append(execution.job_id)
                if execution.worker_name and not living.get(execution.worker_name, False):
                    dead.add(execution.worker_name)
        finally:
            connection.delete(lock)
    for worker_name in sorted(dead):
        release_dead_worker(connection, worker_name)
        rqexec.forget_worker(connection, worker_name, queue_names)
        report.dead_workers.append(worker_name)
    for name in shared:
        if report.rerun.get(name) or report.crashed.get(name):
            log.warning(
                "queue %s: jobs of dead workers %s re-queued %s, failed (crash budget spent) %s",
                name,
                report.dead_workers,
                report.rerun.get(name, []),
                report.crashed.get(name, []),
            )
    return report


def _why_dead(
    connection: Redis, queue: Queue, execution: Execution, living: dict[str, bool], at: float
) -> str | None:
    """Why this execution's worker counts as dead, or None while it is alive."""
    name = execution.worker_name
    if name and living.get(name):
        if rqexec.heartbeat_expired(queue, execution, at):
            return f"worker {name} stopped heartbeating the job"
        return None
    if not name:
        return "its execution record expired" if rqexec.heartbeat_expired(queue, execution, at) else None
    kvrq_worker = rqexec.is_kvrq_worker(connection, name, CAPACITY_FIELD)
    if kvrq_worker is False and not rqexec.heartbeat_expired(queue, execution, at):
        return None  # a worker of another kind: rq's own heartbeat decides
    return f"worker {name} is gone"


def clean_queues(
    connection: Redis,
    queue_names: list[str],
    *,
    now: float | None = None,
    crash_reruns: int = DEFAULT_CRASH_RERUNS,
) -> MaintenanceReport:
    """Crash re-runs, then rq's registry cleanup on each queue, under rq's per-queue maintenance lock.

    `now` (unix time) treats heartbeats older than it as expired (tests, and an operator
    who knows a worker is gone, can pass a later time).
    """
    report = rerun_crashed(connection, queue_names, now=now, crash_reruns=crash_reruns)
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
