"""`kvrq demo --spawn`: the first command starts Redis and a worker, shows warm resumes, cleans up."""

from __future__ import annotations

import re
import socket
import subprocess
import sys

import pytest

from tests.worker.procs import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_demo_spawns_shows_warm_resumes_and_cleans_up() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker.cli", "demo", "--spawn", "--max-tokens", "4"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, out + err
    turns = re.findall(r"\[(harbour-guide|route-planner), turn (\d)\]", out)
    assert len(turns) == 6
    reused = [int(n) for n in re.findall(r"reused (\d+) of \d+ prompt tokens", out)]
    first_token = [float(s) for s in re.findall(r"first token ([\d.]+) s", out)]
    assert reused[:2] == [0, 0] and all(n > 500 for n in reused[2:])  # turn 1 cold, turns 2-3 warm
    assert max(first_token[2:]) < min(first_token[:2])  # the warm resume is visible at a glance
    # Everything it started is gone: the worker (its queue is named after the demo's pid) and Redis.
    leftovers = subprocess.run(["pgrep", "-f", f"kvrq-demo-{proc.pid}"], capture_output=True, text=True)
    assert leftovers.stdout.strip() == ""
    port = int(re.search(r"started redis-server at redis://127\.0\.0\.1:(\d+)/", out).group(1))  # type: ignore[union-attr]
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        pass
