"""The stack a client under test talks to: redis-server, a real `kvrq worker` on one model, `kvrq
serve` with a body limit that holds an agent CLI's request, and the recording proxy in front."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redis import Redis
from rq.job import Job
from rq.serializers import JSONSerializer

from producer.models import GenerationRequest, GenerationResult
from tests.clients.proxy import RecordingProxy
from tests.http.test_integration import ServeProcess
from tests.worker.procs import RedisProcess, WorkerProcess, wait_for

#: Claude Code's default request is ~250 KB of JSON (24 tools); kvrq serve's default limit is 8 MB.
MAX_BODY_MB = 8


@dataclass
class FinishedJob:
    """A job kvrq serve enqueued, as the worker ran it."""

    request: GenerationRequest
    result: GenerationResult
    enqueued_at: float


class ClientStack:
    """Everything up and serving `model`; `url` is the proxy's (what clients are pointed at)."""

    def __init__(self, model: str, workdir: Path) -> None:
        self.model = model
        self.workdir = workdir
        self.redis_proc = RedisProcess(workdir)
        self.worker: WorkerProcess | None = None
        self.serve: ServeProcess | None = None
        self.proxy: RecordingProxy | None = None

    def start(self) -> ClientStack:
        self.redis_proc.start()
        name = f"clients-{Path(self.model).name}"
        args = ["--model", self.model, "--max-batch", "4"]
        self.worker = WorkerProcess(self.redis_proc.url, self.workdir, name=name, args=args).start(
            timeout=300
        )
        # kvrq's default body limit, over the http tests' tiny one (later options win)
        self.serve = ServeProcess(self.redis_proc.url, self.workdir, ["--max-body-mb", str(MAX_BODY_MB)])
        serve = self.serve
        wait_for(
            lambda: serve.serves(self.model) or serve.proc.poll() is not None, 60, "kvrq serve did not start"
        )
        assert serve.proc.poll() is None, serve.log()
        self.proxy = RecordingProxy(serve.url).start()
        return self

    def stop(self) -> None:
        for part in (self.proxy, self.serve, self.worker, self.redis_proc):
            if part is not None:
                part.stop()

    @property
    def url(self) -> str:
        assert self.proxy is not None
        return self.proxy.url

    @property
    def redis(self) -> Redis:
        return Redis.from_url(self.redis_proc.url)

    def finished_jobs(self, since: float = 0.0) -> list[FinishedJob]:
        """Every finished job enqueued at or after `since` (epoch seconds), oldest first."""
        connection = self.redis
        found = []
        for key in connection.scan_iter("rq:job:*"):
            job_id = key.decode().removeprefix("rq:job:")
            if ":" in job_id:
                continue
            job = Job.fetch(job_id, connection=connection, serializer=JSONSerializer)
            if job.get_status() != "finished" or job.enqueued_at is None:
                continue
            enqueued = job.enqueued_at.timestamp()
            if enqueued >= since:
                found.append(FinishedJob(_request(job), _result(job), enqueued))
        return sorted(found, key=lambda f: f.enqueued_at)

    def logs(self) -> str:
        serve = self.serve.log()[-4000:] if self.serve is not None else ""
        worker = self.worker.log()[-4000:] if self.worker is not None else ""
        return f"--- worker ---\n{worker}\n--- serve ---\n{serve}"


def _request(job: Job) -> GenerationRequest:
    payload: Any = job.args[0]
    return GenerationRequest.model_validate(payload)


def _result(job: Job) -> GenerationResult:
    value: Any = job.return_value()
    return GenerationResult.model_validate(value)
