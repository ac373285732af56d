"""Start a private redis-server or kvrq worker as child processes, and stop them on exit.

Used by `kvrq demo --spawn` and the benchmarks: everything they start, they stop.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from redis import Redis
from redis.exceptions import RedisError

from producer.wire.protocol import DEFAULT_QUEUE
from producer.wire.redis_url import connect
from worker.jobs import rqexec


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def redis_server(workdir: Path) -> Iterator[str]:
    """A redis-server on a free loopback port, keeping nothing on disk; yields its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server not found: apt-get install redis-server (macOS: brew install redis)")
    port = free_port()
    command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(
        [*command, "--dir", str(workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        wait_until(lambda: _pings(url), 10, "redis-server did not start")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def worker_command(redis_url: str, *, queue: str, store: str, name: str | None = None) -> list[str]:
    """The argv that starts `kvrq worker` with this interpreter (no console script needed)."""
    command = [sys.executable, "-m", "worker.cli", "worker", "--redis", redis_url, "--queue", queue]
    command += ["--store", store]
    return command + (["--name", name] if name else [])


@contextmanager
def worker_process(
    redis_url: str,
    *,
    queue: str = DEFAULT_QUEUE,
    store: str,
    name: str | None = None,
    args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    timeout: float = 300,
) -> Iterator[subprocess.Popen[bytes]]:
    """`kvrq worker` as a child process, yielded once it is registered; SIGTERM (drain) on exit."""
    command = worker_command(redis_url, queue=queue, store=store, name=name)
    with tempfile.TemporaryFile() as log_file:
        proc = subprocess.Popen([*command, *args], stdout=log_file, stderr=subprocess.STDOUT, env=env)
        try:
            connection = connect(redis_url)
            wait_until(
                lambda: proc.poll() is not None or _listens(connection, queue), timeout, "no worker started"
            )
            if proc.poll() is not None:
                log_file.seek(0)
                log = log_file.read().decode(errors="replace")
                raise SystemExit(f"the worker exited with {proc.returncode}:\n{log}")
            yield proc
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def _listens(connection: Redis, queue: str) -> bool:
    return bool(connection.scard(rqexec.workers_key(queue)))


def _pings(url: str) -> bool:
    try:
        return bool(connect(url).ping())
    except RedisError:
        return False


def wait_until(condition: Callable[[], bool], timeout: float, message: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise SystemExit(message)
