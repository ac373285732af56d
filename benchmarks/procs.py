"""Real processes for benchmarks and integration tests alike: redis-server, `kvrq worker`, `kvrq serve`,
and a stand-in worker that answers jobs at once (so a run measures the path around the model).

tests/ imports these (tests/worker/procs.py adds its rule for a missing redis-server: skip, or fail
under CI); nothing here imports from tests/.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Protocol, TypeVar

import httpx
from redis import Redis
from rq import Queue, Worker
from rq.job import Job, JobStatus
from rq.results import Result
from rq.serializers import JSONSerializer

from producer.wire.protocol import MODEL_FIELD, StreamEvent, stream_key
from producer.wire.redis_url import connect
from producer.wire.text import as_text
from worker.cli.spawn import free_port, worker_command

ROOT = Path(__file__).resolve().parents[1]
STAND_IN_MODEL = "stand-in"


def wait_for(condition: Callable[[], object], timeout: float, message: str, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(interval)
    raise AssertionError(message)


def redis_server() -> str:
    """The redis-server on PATH (the tests pass their own lookup: skipped locally, failed under CI)."""
    found = shutil.which("redis-server")
    if found is None:
        raise RuntimeError("no redis-server on PATH: apt-get install redis-server; macOS: brew install redis")
    return found


class Startable(Protocol):
    def start(self) -> object: ...

    def stop(self) -> None: ...


P = TypeVar("P", bound=Startable)


@contextlib.contextmanager
def running(proc: P) -> Iterator[P]:
    """`proc` started, and stopped however the block ends."""
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()


class RedisProcess:
    """redis-server on 127.0.0.1; `persistent` keeps its data (AOF) across stop/start on the same port."""

    def __init__(
        self, workdir: Path, *, persistent: bool = False, binary: str | None = None, port: int | None = None
    ) -> None:
        self.binary = binary or redis_server()
        self.workdir = workdir
        self.persistent = persistent
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        persistence = (
            ["--appendonly", "yes", "--appendfsync", "always"] if self.persistent else ["--appendonly", "no"]
        )
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                *persistence,
                "--dir",
                str(self.workdir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for(lambda: accepts(self.port), 10, "redis-server did not start")
        wait_for(lambda: _loaded(self.url), 10, "redis-server did not load its data")

    def stop(self, kill: bool = False) -> None:
        """Stop it (`kill`: SIGKILL, as a crash would, instead of a clean SIGTERM)."""
        if self.proc is not None:
            if kill:
                self.proc.kill()
            else:
                self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None


class WorkerProcess:
    """`python -m worker.cli worker ...` (the CLI preloads OpenBLAS itself), logging to a file."""

    def __init__(
        self,
        redis_url: str,
        workdir: Path,
        *,
        name: str,
        queue: str = "kvrq",
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.redis_url = redis_url
        self.name = name
        self.queue = queue
        self.log_path = workdir / f"{name}.log"
        self.command = [
            *worker_command(redis_url, queue=queue, store=f"disk:{workdir / 'cache'}", name=name),
            *args,
        ]
        self.env = {**os.environ, "KVRQ_HEARTBEAT_INTERVAL": "0.5", **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 180) -> WorkerProcess:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT
            )
        connection = connect(self.redis_url)  # any kvrq URL form, Sentinel's too
        wait_for(lambda: self.exited() or self.registered(connection), timeout, "worker did not register")
        if self.exited():
            raise AssertionError(f"worker exited with {self.proc.returncode}:\n{self.log()}")
        return self

    def registered(self, connection: Redis) -> bool:
        return bool(connection.sismember("rq:workers", f"rq:worker:{self.name}"))

    def exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def terminate(self, timeout: float = 120) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


class ServeProcess:
    """`python -m worker.cli serve` on a free loopback port, logging to a file."""

    def __init__(self, redis_url: str, workdir: Path, args: Sequence[str] = ()) -> None:
        """`args`: more `kvrq serve` options (an API key file, a body limit)."""
        self.redis_url = redis_url
        self.port = free_port()
        self.log_path = workdir / "serve.log"
        command = [
            sys.executable,
            "-m",
            "worker.cli",
            "serve",
            "--redis",
            redis_url,
            "--port",
            str(self.port),
        ]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([*command, *args], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def serves(self, model: str) -> bool:
        try:
            return model in httpx.get(f"{self.url}/health", timeout=1).json()["models"]
        except (httpx.HTTPError, ValueError, KeyError):
            return False

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


class StandInWorker:
    """Takes kvrq jobs from the queue and finishes them as a kvrq worker would, in Redis: a stream
    (start, three deltas that spell the request's last message, end) and an rq result."""

    def __init__(self, url: str) -> None:
        self.connection = Redis.from_url(url)
        self.queue = Queue("kvrq", connection=self.connection, serializer=JSONSerializer)
        self.rq_worker = Worker(
            [self.queue], connection=self.connection, name="stand-in", serializer=JSONSerializer
        )
        self.stop = threading.Event()
        self.jobs = 0
        self.thread = threading.Thread(target=self.run, daemon=True)

    def start(self) -> None:
        self.rq_worker.register_birth()
        self.connection.hset(self.rq_worker.key, MODEL_FIELD, STAND_IN_MODEL)  # what a kvrq worker announces
        self.thread.start()

    def run(self) -> None:
        while not self.stop.is_set():
            popped = self.connection.blpop([self.queue.key], timeout=1)
            if popped is not None:
                self.answer(as_text(popped[1]))

    def begin(self, job_id: str) -> None:
        """The start of an answer that never ends: the stream's start and first delta."""
        text = self.events(job_id)[1].text
        for event in self.events(job_id)[:2]:
            self.connection.xadd(stream_key(job_id), event.to_fields())  # type: ignore[arg-type]
        assert text

    def events(self, job_id: str) -> list[StreamEvent]:
        """start, then three deltas that spell the request's last message."""
        job = Job.fetch(job_id, connection=self.connection, serializer=JSONSerializer)
        text = job.args[0]["messages"][-1]["content"]
        thirds = [
            text[: len(text) // 3],
            text[len(text) // 3 : 2 * len(text) // 3],
            text[2 * len(text) // 3 :],
        ]
        return [StreamEvent("start", attempt="1")] + [StreamEvent("delta", text=t, token=1) for t in thirds]

    def answer(self, job_id: str) -> None:
        job = Job.fetch(job_id, connection=self.connection, serializer=JSONSerializer)
        text = job.args[0]["messages"][-1]["content"]
        events = self.events(job_id)
        result = {
            "job_id": job_id,
            "agent_id": job.args[0].get("agent_id"),
            "text": text,
            "token_ids": [1, 1, 1],
            "finish_reason": "stop",
            "usage": {"prompt_tokens": 9, "reused_tokens": 0, "prefilled_tokens": 9, "generated_tokens": 3},
            "timings": {"queued_s": 0.0, "time_to_first_token_s": 0.0, "total_s": 0.0},
        }
        with self.connection.pipeline() as pipe:
            for event in [*events, StreamEvent("end", finish_reason="stop")]:
                pipe.xadd(stream_key(job_id), event.to_fields())  # type: ignore[arg-type]
            Result.create(job, Result.Type.SUCCESSFUL, ttl=600, return_value=result, pipeline=pipe)
            job.set_status(JobStatus.FINISHED, pipeline=pipe)
            pipe.execute()
        self.jobs += 1

    def pause(self) -> None:
        """Take no more jobs; stay registered, so the model is still served."""
        self.stop.set()
        self.thread.join(timeout=5)

    def close(self) -> None:
        self.pause()
        self.rq_worker.register_death()


@contextlib.contextmanager
def stand_in_stack(
    workdir: Path,
    *,
    redis: type[RedisProcess] = RedisProcess,
    stand_in: type[StandInWorker] = StandInWorker,
    serve: type[ServeProcess] = ServeProcess,
) -> Iterator[tuple[ServeProcess, StandInWorker]]:
    """A redis-server, the stand-in worker and a `kvrq serve` that lists its model."""
    redis_proc = redis(workdir)
    redis_proc.start()
    worker = stand_in(redis_proc.url)
    worker.start()
    server = serve(redis_proc.url, workdir)
    try:
        wait_for(
            lambda: server.serves(STAND_IN_MODEL) or server.proc.poll() is not None,
            60,
            "kvrq serve did not start",
        )
        assert server.proc.poll() is None, server.log()
        yield server, worker
    finally:
        server.stop()
        worker.close()
        redis_proc.stop()


def accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def _loaded(url: str) -> bool:
    try:
        return bool(Redis.from_url(url).ping())
    except Exception:
        return False
