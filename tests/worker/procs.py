"""Real processes for integration tests: a redis-server that may persist and restart, and `kvrq worker`."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from redis import Redis

from producer.wire.redis_url import connect
from tests.conftest import REDIS_SERVER_HINT, free_port, require_binary
from worker.cli.spawn import worker_command

ROOT = Path(__file__).resolve().parents[2]


class RedisProcess:
    """redis-server on 127.0.0.1; `persistent` keeps its data (AOF) across stop/start on the same port."""

    def __init__(self, workdir: Path, *, persistent: bool = False) -> None:
        self.binary = require_binary("redis-server", REDIS_SERVER_HINT)
        self.workdir = workdir
        self.persistent = persistent
        self.port = free_port()
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
        wait_for(lambda: _accepts(self.port), 10, "redis-server did not start")
        wait_for(lambda: _loaded(self.url), 10, "redis-server did not load its data")

    def stop(self) -> None:
        if self.proc is not None:
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


def wait_for(condition, timeout: float, message: str, interval: float = 0.05) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(interval)
    raise AssertionError(message)


def _accepts(port: int) -> bool:
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


@contextlib.contextmanager
def worker_per_queue(
    redis_url: str, factory: Any, label: str, queues: Sequence[str], args: Sequence[str]
) -> Iterator[list[WorkerProcess]]:
    """One started `kvrq worker` per queue (named kvrq-<label>-<queue>), all killed on exit."""
    procs = [
        WorkerProcess(
            redis_url,
            factory.mktemp(f"{label}-{queue}"),
            name=f"kvrq-{label}-{queue}",
            queue=queue,
            args=args,
        )
        for queue in queues
    ]
    try:
        for proc in procs:
            proc.start()
        yield procs
    finally:
        for proc in procs:
            proc.stop()
