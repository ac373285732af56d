"""The README's long-running stack commands, run as the README spells them, from a clone-like directory.

Only port numbers change (to free loopback ports: other Redis servers and test runs share the
machine). Each run must bring up Redis, register an rq worker (the real builtin model) and serve
rq-dashboard's pages, then stop on Ctrl-C with nothing left running.
"""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from redis import Redis
from redis.exceptions import RedisError

from benchmarks.procs import accepts
from tests.conftest import free_port
from tests.worker.stackhelp import (
    ShellCommand,
    descendants,
    http_get,
    like_a_clone,
    readme_command,
    rq_workers,
    serves,
    wait_gone,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

README_PORT = "6390"  # the free port the README suggests where 6379 is taken
STARTUP_S = 240  # model load: 10-20 s on a quiet machine, much more on a busy one


def with_port(command: str, redis_port: int) -> str:
    assert README_PORT in command, command
    return command.replace(README_PORT, str(redis_port))


def check_stack_and_stop(
    run: ShellCommand, redis_port: int, dashboard_port: int, http_port: int, says: str = ""
) -> None:
    """Redis answers, a worker of this command registers, the dashboard serves it, kvrq serve lists its
    model, the command `says` its line; Ctrl-C stops all, with no ERROR logged."""
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    try:
        run.wait_for(lambda: accepts(redis_port), 30, "Redis did not start")
        assert Redis.from_url(redis_url).ping()
        ours = lambda: [w for w in rq_workers(redis_url) if w.pid in descendants(run.proc.pid)]  # noqa: E731
        # Until a worker registers, a Redis that went away means the command stopped: say what it printed.
        registered = lambda: bool(_or_none(ours))  # noqa: E731
        run.wait_for(registered, STARTUP_S, "no worker registered")
        worker = ours()[0]
        assert "kvrq" in [q.name for q in worker.queues]
        base = f"http://127.0.0.1:{dashboard_port}"
        run.wait_for(lambda: serves(f"{base}/0/view/workers"), 60, "the dashboard does not serve")
        status, body = http_get(f"{base}/0/data/workers.json")
        assert status == 200
        assert [w["name"] for w in json.loads(body)["workers"]] == [worker.name]
        assert http_get(f"{base}/0/data/queues.json")[0] == 200
        health = f"http://127.0.0.1:{http_port}/health"
        run.wait_for(lambda: serves(health), 60, "kvrq serve does not serve")
        run.wait_for(lambda: b"smollm2-135m" in http_get(health)[1], 30, "kvrq serve lists no model")
        run.wait_for(lambda: says in run.log(), 10, f"never said {says!r}")
        started = descendants(run.proc.pid) | {run.proc.pid}
    except BaseException:
        run.kill_all()
        raise
    run.ctrl_c()
    assert wait_gone(started) == [], run.log()
    assert not accepts(redis_port) and not accepts(dashboard_port) and not accepts(http_port)
    # A clean stop logs no ERROR (rq's command listener logged one when Redis stopped beside the worker).
    assert not re.findall(r"^.*\bERROR\b.*$", run.log(), re.M), run.log()


def test_readme_kvrq_up_runs_the_stack_and_ctrl_c_stops_everything(tmp_path: Path) -> None:
    command = readme_command(r"\.venv/bin/kvrq up --redis-port 6390")
    redis_port, dashboard_port, http_port = free_port(), free_port(), free_port()
    clone = like_a_clone(tmp_path)
    ports = {"KVRQ_DASHBOARD_PORT": str(dashboard_port), "KVRQ_HTTP_PORT": str(http_port)}
    run = ShellCommand(with_port(command, redis_port), clone, ports)
    check_stack_and_stop(run, redis_port, dashboard_port, http_port, says="worker ready")
    assert run.proc.returncode == 0, run.log()
    log = run.log()
    assert re.search(r"^redis +\| ", log, re.M) and re.search(r"^worker +\| ", log, re.M), log
    assert "stopped (redis 0, worker 0, dashboard 0, http 0)" in log, log
    assert any((clone / ".kvrq" / "redis").glob("appendonlydir/*.aof")), "Redis ran without AOF"


def test_readme_honcho_command_runs_the_procfile(tmp_path: Path) -> None:
    command = readme_command(r"KVRQ_REDIS_PORT=6390 \.venv/bin/honcho start")
    redis_port, dashboard_port, http_port = free_port(), free_port(), free_port()
    ports = {"KVRQ_DASHBOARD_PORT": str(dashboard_port), "KVRQ_HTTP_PORT": str(http_port)}
    run = ShellCommand(with_port(command, redis_port), like_a_clone(tmp_path), ports)
    check_stack_and_stop(run, redis_port, dashboard_port, http_port)
    assert "not found" not in run.log()


def test_kvrq_up_on_a_taken_port_says_so_and_starts_nothing(tmp_path: Path) -> None:
    """What `.venv/bin/kvrq up` does where a Redis already listens on 6379 (as on CI machines)."""
    command = readme_command(r"\.venv/bin/kvrq up")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = ShellCommand(command, like_a_clone(tmp_path), {"KVRQ_REDIS_PORT": str(port)})
        assert run.proc.wait(timeout=60) == 2
    assert f"127.0.0.1:{port} is already in use" in run.log() and "--redis-port" in run.log()
    assert not (tmp_path / ".kvrq").exists()


def _or_none(probe: Callable[[], list[Any]]) -> list[Any]:
    try:
        return probe()
    except RedisError:
        return []
