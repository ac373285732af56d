"""`kvrq up` and `kvrq dashboard`: the long-running stack from one command.

`kvrq up` runs what the Procfile runs (Redis on loopback with AOF persistence, a worker,
rq-dashboard, the HTTP server `kvrq serve`) as its own child processes, prefixes their output with
their names, and on Ctrl-C or SIGTERM stops them in an order that loses nothing: the HTTP server
and the dashboard, then the worker (which drains: its jobs finish or go back to their queue), then
Redis (which writes its AOF). With `--sentinel` Redis is a primary, a replica and three sentinels
(stopped first, so stopping the stack fails nothing over). Children run in their own sessions so
Ctrl-C reaches only `kvrq up`, and on Linux they get SIGTERM if it dies without stopping them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from redis import Redis
from redis.exceptions import RedisError

from producer.wire.redis_url import connect
from worker.cli.dashboard import DEFAULT_PORT as DEFAULT_DASHBOARD_PORT
from worker.cli.dashboard import LOOPBACK, add_dashboard_command
from worker.cli.serve_http import DEFAULT_PORT as DEFAULT_HTTP_PORT
from worker.jobs import rqexec

DEFAULT_REDIS_PORT = 6379
REDIS_PORT_ENV = "KVRQ_REDIS_PORT"  # the Procfile's variables, so both start the same stack
DASHBOARD_PORT_ENV = "KVRQ_DASHBOARD_PORT"
HTTP_PORT_ENV = "KVRQ_HTTP_PORT"
REDIS_START_S = 10.0
STOP_GRACE_S = 10.0  # redis-server and the dashboard; the worker gets its drain timeout on top
#: redis.conf lines for every data server (primary and replicas) of a Sentinel-managed Redis: a primary
#: that has lost its replica refuses writes (NOREPLICAS, which kvrq retries) rather than acknowledge writes
#: a failover would drop; the lag bound is how stale (seconds) the replica's last ack may be. With one
#: replica this makes an acknowledged write survive a failover (docs/scale-out.md, "Sentinel").
SENTINEL_DATA_CONFIG = ("min-replicas-to-write 1", "min-replicas-max-lag 10")
SENTINEL_MASTER = "kvrq"
SENTINEL_PORT_OFFSET = 20000  # `kvrq up --sentinel`: sentinels on the Redis port + 20000, +1, +2 (26379...)
SENTINELS = 3


def add_stack_commands(commands: argparse._SubParsersAction) -> None:
    """Register `kvrq up` and `kvrq dashboard` on the CLI's subcommands."""
    up = commands.add_parser(
        "up",
        help="run Redis, a worker, rq-dashboard and the HTTP server until Ctrl-C",
        description="Run the whole stack on 127.0.0.1: redis-server (AOF persistence in DIR/redis), "
        "a kvrq worker (agent caches in DIR/cache; its settings from KVRQ_* variables, see "
        "docs/worker.md), rq-dashboard and kvrq serve (docs/http.md). Ctrl-C stops them all: "
        "the worker drains first.",
    )
    up.add_argument(
        "--redis-port",
        type=int,
        help=f"Redis port [${REDIS_PORT_ENV} or {DEFAULT_REDIS_PORT}]",
    )
    up.add_argument(
        "--dashboard-port",
        type=int,
        help=f"rq-dashboard port [${DASHBOARD_PORT_ENV} or {DEFAULT_DASHBOARD_PORT}]",
    )
    up.add_argument(
        "--dir", type=Path, default=Path(".kvrq"), help="where Redis and the store keep data [.kvrq]"
    )
    up.add_argument(
        "--http-port",
        type=int,
        help=f"kvrq serve's port (OpenAI and Anthropic HTTP) [${HTTP_PORT_ENV} or {DEFAULT_HTTP_PORT}]",
    )
    up.add_argument(
        "--sentinel",
        action="store_true",
        help="run Redis as a primary (the Redis port), a replica (port + 1) and 3 sentinels (port + 20000, "
        "+1, +2), with min-replicas-to-write 1; every process uses the redis+sentinel:// URL "
        "(docs/scale-out.md)",
    )
    up.add_argument("--no-dashboard", action="store_true", help="run no rq-dashboard")
    up.add_argument("--no-http", action="store_true", help="run no HTTP server (kvrq serve)")
    up.set_defaults(func=_cmd_up)

    add_dashboard_command(commands)


def _env_port(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise SystemExit(f"{name}={raw!r} is not a port number") from None


def _cmd_up(args: argparse.Namespace) -> int:
    if args.redis_port is None:
        args.redis_port = _env_port(REDIS_PORT_ENV, DEFAULT_REDIS_PORT)
    if args.dashboard_port is None:
        args.dashboard_port = _env_port(DASHBOARD_PORT_ENV, DEFAULT_DASHBOARD_PORT)
    if args.http_port is None:
        args.http_port = _env_port(HTTP_PORT_ENV, DEFAULT_HTTP_PORT)
    problem = _cannot_start(args)
    if problem:
        print(f"kvrq up: {problem}", file=sys.stderr)
        return 2
    dashboard_port = None if args.no_dashboard else args.dashboard_port
    http_port = None if args.no_http else args.http_port
    return Stack(args.redis_port, dashboard_port, args.dir, http_port, sentinel=args.sentinel).run()


def _cannot_start(args: argparse.Namespace) -> str | None:
    """Why the stack cannot start, checked before anything is started."""
    if shutil.which("redis-server") is None:
        return "redis-server not found: apt-get install redis-server (macOS: brew install redis)"
    import importlib.util

    if not args.no_dashboard and importlib.util.find_spec("rq_dashboard") is None:
        return "rq-dashboard is not installed: pip install -e '.[dashboard]', or run with --no-dashboard"
    if not args.no_http and not all(importlib.util.find_spec(name) for name in ("fastapi", "uvicorn")):
        return "kvrq serve needs fastapi and uvicorn: pip install -e '.[serve]', or run with --no-http"
    ports = [("Redis", "--redis-port", REDIS_PORT_ENV, args.redis_port)]
    if getattr(args, "sentinel", False):
        extra = [1, *(SENTINEL_PORT_OFFSET + n for n in range(SENTINELS))]
        ports += [
            ("the replica and sentinels", "--redis-port", REDIS_PORT_ENV, args.redis_port + n) for n in extra
        ]
    if not args.no_dashboard:
        ports.append(("the dashboard", "--dashboard-port", DASHBOARD_PORT_ENV, args.dashboard_port))
    if not args.no_http:
        ports.append(("the HTTP server", "--http-port", HTTP_PORT_ENV, args.http_port))
    for what, flag, env, port in ports:
        if not port_is_free(port):
            return (
                f"{LOOPBACK}:{port} is already in use (another Redis or an earlier kvrq up?); "
                f"pick a free port for {what}: {flag} N or {env}=N"
            )
    if len({port for *_, port in ports}) < len(ports):
        return f"{', '.join(what for what, *_ in ports)} need different ports"
    return None


def port_is_free(port: int) -> bool:
    """Whether a server could listen on 127.0.0.1:port now (SO_REUSEADDR, as servers bind)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


@dataclass
class Child:
    """One process of the stack and the thread that copies its output, prefixed."""

    name: str
    proc: subprocess.Popen[bytes]
    pump: threading.Thread

    def exited(self) -> bool:
        return self.proc.poll() is not None

    def stop(self, timeout: float, sig: int = signal.SIGTERM) -> None:
        """Signal it, wait up to `timeout`, then kill it; always reaps it."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                print(f"kvrq up: {self.name} did not stop in {timeout:.0f} s: killing it", flush=True)
                self.proc.kill()
                self.proc.wait()
        if self.pump.ident is not None:
            self.pump.join(timeout=5)


class Stack:
    def __init__(
        self,
        redis_port: int,
        dashboard_port: int | None,
        data_dir: Path,
        http_port: int | None = None,
        *,
        sentinel: bool = False,
    ) -> None:
        self.redis_url = f"redis://{LOOPBACK}:{redis_port}/0"
        self.redis_port = redis_port
        self.sentinel_ports = (
            [redis_port + SENTINEL_PORT_OFFSET + n for n in range(SENTINELS)] if sentinel else []
        )
        if sentinel:
            hosts = ",".join(f"{LOOPBACK}:{port}" for port in self.sentinel_ports)
            self.redis_url = f"redis+sentinel://{hosts}/{SENTINEL_MASTER}/0"
        self.dashboard_port = dashboard_port
        self.http_port = http_port
        self.data_dir = data_dir
        self.children: dict[str, Child] = {}
        self.signals = 0
        self._print_lock = threading.Lock()
        self._die_with_parent = _parent_death_signal()

    def run(self) -> int:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self._run()
        finally:
            self._stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _run(self) -> int:
        """Fork every child before any output thread starts (no threads at fork time), then watch."""
        (self.data_dir / "redis").mkdir(parents=True, exist_ok=True)
        redis = self._start("redis", self._redis_argv())
        if self.sentinel_ports:
            self._start_replica_and_sentinels()
        connection = connect(self.redis_url, socket_timeout=2)
        ready = self._wait(lambda: bool(self.signals) or redis.exited() or _pings(connection), REDIS_START_S)
        if self.signals:  # Ctrl-C while Redis was starting
            self._pump_all()
            return 0
        if not ready or redis.exited():
            self._pump_all()
            self.say(f"redis-server did not start on {LOOPBACK}:{self.redis_port}")
            return 1
        worker = self._start("worker", self._worker_argv())
        if self.dashboard_port is not None:
            self._start("dashboard", self._dashboard_argv())
        if self.http_port is not None:
            self._start("http", self._http_argv())
        self._pump_all()
        dashboard = (
            f", rq-dashboard on http://{LOOPBACK}:{self.dashboard_port}" if self.dashboard_port else ""
        )
        http = f", OpenAI and Anthropic HTTP on http://{LOOPBACK}:{self.http_port}" if self.http_port else ""
        self.say(
            f"Redis at {self.redis_url}{dashboard}{http}; the worker is loading its model. Ctrl-C stops all."
        )
        announced = False
        while not self.signals:
            for child in self.children.values():
                if child.exited():
                    self.say(f"{child.name} exited with code {child.proc.returncode}: stopping the stack")
                    return 1
            if not announced and _registered(connection, worker.proc.pid):
                self.say(
                    f"worker ready: enqueue to {self.redis_url} (kvrq generate --redis {self.redis_url} Hi)"
                )
                announced = True
            time.sleep(0.2)
        return 0

    def _redis_argv(self, port: int | None = None, data_dir: Path | None = None) -> list[str]:
        argv = [
            shutil.which("redis-server") or "redis-server",
            "--bind", LOOPBACK,
            "--protected-mode", "yes",
            "--port", str(port or self.redis_port),
            "--dir", str(data_dir or self.data_dir / "redis"),
            "--appendonly", "yes",
            "--appendfsync", "everysec",
        ]  # fmt: skip
        if self.sentinel_ports:
            for line in SENTINEL_DATA_CONFIG:
                name, value = line.split(" ", 1)
                argv += [f"--{name}", value]
        return argv

    def _start_replica_and_sentinels(self) -> None:
        """The primary's replica and three sentinels; the data servers get SENTINEL_DATA_CONFIG."""
        replica_dir = self.data_dir / "redis-replica"
        replica_dir.mkdir(parents=True, exist_ok=True)
        argv = self._redis_argv(self.redis_port + 1, replica_dir)
        self._start("replica", [*argv, "--replicaof", LOOPBACK, str(self.redis_port)])
        sentinel_dir = self.data_dir / "sentinel"
        sentinel_dir.mkdir(parents=True, exist_ok=True)
        for index, port in enumerate(self.sentinel_ports):
            config = sentinel_dir / f"sentinel-{port}.conf"  # Sentinel rewrites it: what it learned survives
            if not config.exists():
                config.write_text(
                    f"port {port}\nbind {LOOPBACK}\nprotected-mode yes\ndir {sentinel_dir.resolve()}\n"
                    f"sentinel monitor {SENTINEL_MASTER} {LOOPBACK} {self.redis_port} 2\n"
                    f"sentinel down-after-milliseconds {SENTINEL_MASTER} 5000\n"
                    f"sentinel failover-timeout {SENTINEL_MASTER} 60000\n"
                )
            binary = shutil.which("redis-server") or "redis-server"
            self._start(f"sentinel{index + 1}", [binary, str(config), "--sentinel"])

    def _worker_argv(self) -> list[str]:
        store = f"disk:{self.data_dir / 'cache'}"
        return [sys.executable, "-m", "worker.cli", "worker", "--redis", self.redis_url, "--store", store]

    def _dashboard_argv(self) -> list[str]:
        port = str(self.dashboard_port)
        return [sys.executable, "-m", "worker.cli", "dashboard", "--redis", self.redis_url, "--port", port]

    def _http_argv(self) -> list[str]:
        port = str(self.http_port)
        return [sys.executable, "-m", "worker.cli", "serve", "--redis", self.redis_url, "--port", port]

    def _start(self, name: str, argv: list[str]) -> Child:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,  # Ctrl-C goes to `kvrq up` alone, which stops them in order
            preexec_fn=self._die_with_parent,
        )
        assert proc.stdout is not None
        child = Child(name, proc, threading.Thread(target=self._pump, args=(name, proc.stdout), daemon=True))
        self.children[name] = child
        return child

    def _pump_all(self) -> None:
        for child in self.children.values():
            if child.pump.ident is None:
                child.pump.start()

    def _pump(self, name: str, stream: IO[bytes]) -> None:
        for raw in iter(stream.readline, b""):
            self._print(name, raw.decode(errors="replace").rstrip("\n"))
        stream.close()

    def _print(self, name: str, line: str) -> None:
        with self._print_lock:
            print(f"{name:<9} | {line}", flush=True)

    def say(self, message: str) -> None:
        self._print("kvrq up", message)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.signals += 1
        worker = self.children.get("worker")
        if self.signals == 2 and worker is not None and not worker.exited():
            self.say("second stop signal: the worker hands its jobs back now")
            worker.proc.send_signal(signal.SIGTERM)  # a worker's second signal: no more draining

    def _stop_all(self) -> None:
        """HTTP server and dashboard, then the worker (its drain), then Redis: the worker hands jobs back."""
        if not self.children:
            return
        self.say("stopping: HTTP server, dashboard, worker (finishing or re-queueing its jobs), Redis")
        drain = _drain_timeout()
        order = (
            ("http", STOP_GRACE_S),
            ("dashboard", STOP_GRACE_S),
            ("worker", drain + 60),
            # Sentinels before the data servers: a primary that stops must not be failed over.
            *((f"sentinel{n + 1}", STOP_GRACE_S) for n in range(len(self.sentinel_ports))),
            ("replica", STOP_GRACE_S),
            ("redis", STOP_GRACE_S),
        )
        for name, timeout in order:
            child = self.children.get(name)
            if child is not None:
                child.stop(timeout)
        codes = ", ".join(f"{c.name} {c.proc.returncode}" for c in self.children.values())
        self.say(f"stopped ({codes})")
        self.children.clear()

    @staticmethod
    def _wait(condition: Callable[[], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return True
            time.sleep(0.1)
        return False


def _drain_timeout() -> float:
    """The worker's drain timeout, as the worker reads it (KVRQ_DRAIN_TIMEOUT or its default)."""
    from pydantic import ValidationError

    from worker.settings import WorkerSettings

    try:
        return WorkerSettings().drain_timeout
    except ValidationError:
        return float(WorkerSettings.model_fields["drain_timeout"].default)


def _parent_death_signal() -> Callable[[], None] | None:
    """Linux: a function for the child (between fork and exec) that asks for SIGTERM when its parent
    dies (prctl PR_SET_PDEATHSIG), resolved here in the parent so the child only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    pr_set_pdeathsig, sigterm = ctypes.c_int(1), ctypes.c_ulong(signal.SIGTERM)
    return lambda: prctl(pr_set_pdeathsig, sigterm)


def _pings(connection: Redis) -> bool:
    try:
        return bool(connection.ping())
    except RedisError:
        return False


def _registered(connection: Redis, pid: int) -> bool:
    """Whether the worker with this process id has registered as an rq worker."""
    try:
        keys = connection.smembers(rqexec.workers_key())
        return any(connection.hget(key, "pid") == str(pid).encode() for key in keys)
    except RedisError:
        return False
