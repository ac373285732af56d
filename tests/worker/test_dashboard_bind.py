"""`kvrq dashboard` has no login of its own: it listens on loopback, refuses any other address unless
`--allow-remote` is given, and its --help says how to gate it (a tunnel or an authenticating proxy)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import free_port
from tests.worker.procs import ROOT
from worker.cli.dashboard import is_loopback

DASHBOARD = [sys.executable, "-m", "worker.cli", "dashboard", "--redis", "redis://127.0.0.1:1/0"]


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("192.168.1.10", False),
        ("dashboard.example.com", False),
    ],
)
def test_only_loopback_addresses_count_as_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "dashboard.example.com"])
def test_a_non_loopback_bind_is_refused_without_allow_remote(host: str) -> None:
    run = subprocess.run(
        [*DASHBOARD, "--bind", host, "--port", str(free_port())],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert run.returncode == 2
    (line,) = run.stderr.strip().splitlines()
    assert line.startswith(f"kvrq dashboard: refusing to listen on {host}") and "--allow-remote" in line
    assert "rq-dashboard on" not in run.stdout  # it never listened


def test_allow_remote_lets_it_listen_on_every_address() -> None:
    port = free_port()
    proc = subprocess.Popen(
        [*DASHBOARD, "--bind", "0.0.0.0", "--port", str(port), "--allow-remote"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith(f"rq-dashboard on http://0.0.0.0:{port}")
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


def test_help_says_how_to_gate_it() -> None:
    run = subprocess.run([*DASHBOARD, "--help"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    text = " ".join(run.stdout.split())
    assert run.returncode == 0
    for words in ("no login", "SSH tunnel", "reverse proxy", "API keys do not cover it", "--allow-remote"):
        assert words in text, words
