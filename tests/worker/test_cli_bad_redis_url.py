"""A Redis URL that cannot be used (a port out of range, one that is not a number, port 0, a scheme
Redis does not speak) is one line naming the problem from every `kvrq` command that connects, exit
status 2 (a usage error), no traceback, the password masked. The worker says so before loading its
model (no model is loaded here: it would take the test minutes)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from producer.wire.redis_url import RedisURLError, connect
from tests.worker.procs import ROOT

SECRET = "hunter2-not-shown"
BAD = f"redis://kvrq:{SECRET}@127.0.0.1:99999/0"


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        (BAD, "Port out of range"),
        ("redis://127.0.0.1:63x9/0", "could not be cast to integer"),
        ("redis://127.0.0.1:0/0", "port 0"),
        ("http://127.0.0.1:6379", "unknown Redis URL"),
        ("redis+sentinel://127.0.0.1:26379/", "needs /MASTER"),
    ],
)
def test_connect_names_the_problem_of_a_bad_url(url: str, problem: str) -> None:
    with pytest.raises(RedisURLError, match=problem) as caught:
        connect(url)
    assert SECRET not in str(caught.value)


@pytest.mark.parametrize(
    "command",
    [
        ["status"],
        ["maintenance"],
        ["serve", "--port", "0"],
        ["worker", "--model", "smollm2-135m"],
        ["dashboard", "--port", "0"],
        ["agent", "show", "someone"],
        ["batch", "status"],
    ],
    ids=lambda command: command[0],
)
def test_every_command_prints_one_line_and_exits_2(command: list[str]) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "worker.cli", *command, "--redis", BAD],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    errors = [line for line in run.stderr.splitlines() if line.startswith("kvrq:")]
    assert run.returncode == 2, run.stderr
    assert errors == ["kvrq: bad Redis URL 'redis://kvrq:***@127.0.0.1:99999/0': Port out of range 0-65535"]
    assert "Traceback" not in run.stderr and SECRET not in run.stdout + run.stderr
