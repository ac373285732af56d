"""Fake completion sources for the batch driver: an in-memory one, and a fake worker over real rq data."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from redis import Redis
from rq import Queue
from rq.job import Job, JobStatus
from rq.results import Result

from producer.batch.jobs import JobOutcome, RqJobSource


def fake_result(job_id: str, request: Mapping[str, Any], reused: int = 0) -> dict[str, Any]:
    custom_id = request.get("metadata", {}).get("custom_id", "?")
    return {
        "job_id": job_id,
        "agent_id": request.get("agent_id"),
        "text": f"answer to {custom_id}",
        "token_ids": [1, 2, 3],
        "finish_reason": "length",
        "usage": {
            "prompt_tokens": 20,
            "reused_tokens": reused,
            "prefilled_tokens": 20 - reused,
            "generated_tokens": 3,
        },
        "timings": {"queued_s": 0.0, "time_to_first_token_s": 0.0, "total_s": 0.0},
        "metadata": dict(request.get("metadata", {})),
    }


@dataclass
class FakeJob:
    request: Mapping[str, Any]
    state: str = "queued"
    result: dict[str, Any] | None = None
    error: str | None = None
    code: str | None = None


@dataclass
class FakeJobs:
    """In-memory JobSource: each wait() ends up to `per_wait` queued jobs (oldest first).

    Checks the driver's promises as it goes: never two unfinished jobs of one agent, never more than
    `limit` unfinished jobs, never a submission of an id that already names a job.
    """

    per_wait: int = 3
    limit: int | None = None
    #: (ErrorCode value, message) for a request that fails, None for one that finishes.
    fail_when: Callable[[Mapping[str, Any]], tuple[str, str] | None] = lambda request: None
    on_wait: Callable[[FakeJobs], None] | None = None
    jobs: dict[str, FakeJob] = field(default_factory=dict)
    submitted: list[str] = field(default_factory=list)
    finished_order: list[str] = field(default_factory=list)
    turns: dict[str, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    max_unfinished: int = 0
    retired: list[str] = field(default_factory=list)

    def unfinished(self) -> list[str]:
        return [job_id for job_id, job in self.jobs.items() if job.state in ("queued", "running")]

    def submit(self, jobs: Sequence[tuple[str, Mapping[str, Any]]]) -> None:
        for job_id, request in jobs:
            if job_id in self.jobs:
                self.violations.append(f"{job_id} submitted again")
                continue
            agent = request.get("agent_id")
            if agent is not None and any(
                self.jobs[j].request.get("agent_id") == agent for j in self.unfinished()
            ):
                self.violations.append(f"{job_id}: agent {agent} already has an unfinished job")
            self.jobs[job_id] = FakeJob(dict(request))
            self.submitted.append(job_id)
        self.max_unfinished = max(self.max_unfinished, len(self.unfinished()))
        if self.limit is not None and len(self.unfinished()) > self.limit:
            self.violations.append(f"{len(self.unfinished())} unfinished jobs > limit {self.limit}")

    def lookup(self, job_ids: Sequence[str]) -> dict[str, JobOutcome]:
        out: dict[str, JobOutcome] = {}
        for job_id in job_ids:
            job = self.jobs.get(job_id)
            if job is None:
                out[job_id] = JobOutcome("missing")
            else:
                out[job_id] = JobOutcome(job.state, job.result, job.error, job.code)  # type: ignore[arg-type]
        return out

    def run_some(self, count: int) -> None:
        for job_id in [j for j in self.jobs if self.jobs[j].state == "queued"][:count]:
            job = self.jobs[job_id]
            failure = self.fail_when(job.request)
            if failure is not None:
                job.state = "failed"
                job.code, job.error = failure
            else:
                agent = job.request.get("agent_id")
                turn = self.turns.get(agent, 0) if agent else 0
                if agent:
                    self.turns[agent] = turn + 1
                job.state, job.result = "finished", fake_result(job_id, job.request, reused=10 * turn)
            self.finished_order.append(job_id)

    def wait(self, job_ids: Sequence[str], timeout_s: float) -> None:
        if self.on_wait is not None:
            self.on_wait(self)
        self.run_some(self.per_wait)

    def cancel(self, job_ids: Sequence[str], *, running: bool = False) -> int:
        count = 0
        for job_id in job_ids:
            job = self.jobs.get(job_id)
            if job is not None and job.state == "queued":
                job.state = "canceled"
                count += 1
        return count

    def discard(self, job_ids: Sequence[str]) -> None:
        for job_id in job_ids:
            self.jobs.pop(job_id, None)

    def retire(self, job_ids: Sequence[str], ttl_s: int) -> None:
        self.retired.extend(job_ids)


class RqFakeWorkerSource(RqJobSource):
    """The real rq-backed JobSource; each wait() first plays a worker that finishes `per_wait` queued jobs.

    The fake worker writes results the way rq does (status + Result stream), so lookup, cancel,
    discard and retire run against real rq data structures (on fakeredis).
    """

    def __init__(self, connection: Redis, queue: str, per_wait: int = 4) -> None:
        super().__init__(connection, queue)
        self.queue_obj = Queue(queue, connection=connection, serializer="json")
        self.per_wait = per_wait

    def wait(self, job_ids: Sequence[str], timeout_s: float) -> None:
        for _ in range(self.per_wait):
            job_id = pop_job_id(self.queue_obj)
            if job_id is None:
                break
            job = Job.fetch(job_id, connection=self.connection, serializer="json")
            request = job.args[0]
            with self.connection.pipeline() as pipe:
                job.set_status(JobStatus.FINISHED, pipeline=pipe)
                Result.create(
                    job,
                    Result.Type.SUCCESSFUL,
                    ttl=500,
                    return_value=fake_result(job_id, request),
                    pipeline=pipe,
                )
                pipe.execute()


def pop_job_id(queue: Queue) -> str | None:
    """Queue.pop_job_id of rq 3.0 raises on an empty queue instead of returning None."""
    raw = queue.connection.lpop(queue.key)
    return raw.decode() if isinstance(raw, bytes) else None if raw is None else str(raw)


def read_output(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


class FakeRqWorkerThread:
    """A thread that plays a kvrq worker on a real Redis: pops jobs, writes results the way rq does."""

    def __init__(self, redis_url: str, queue: str = "kvrq", delay_s: float = 0.01) -> None:
        import threading

        self.connection = Redis.from_url(redis_url)
        self.queue = Queue(queue, connection=self.connection, serializer="json")
        self.delay_s = delay_s
        self.stopped = threading.Event()
        self.done: list[str] = []
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> FakeRqWorkerThread:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        self.thread.join(timeout=5)
        self.connection.close()

    def _loop(self) -> None:
        import time

        while not self.stopped.is_set():
            job_id = pop_job_id(self.queue)
            if job_id is None:
                time.sleep(0.01)
                continue
            job = Job.fetch(job_id, connection=self.connection, serializer="json")
            if job.get_status() == JobStatus.CANCELED:
                continue
            time.sleep(self.delay_s)
            with self.connection.pipeline() as pipe:
                job.set_status(JobStatus.FINISHED, pipeline=pipe)
                Result.create(
                    job,
                    Result.Type.SUCCESSFUL,
                    ttl=500,
                    return_value=fake_result(job_id, job.args[0]),
                    pipeline=pipe,
                )
                pipe.execute()
            self.done.append(job_id)
