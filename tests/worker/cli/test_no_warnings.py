"""What a new user runs first prints no warnings: `kvrq --help`, every subcommand's help, the install."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from worker.cli import build_parser

ROOT = Path(__file__).resolve().parents[3]
KVRQ = Path(sys.executable).with_name("kvrq")  # the console script pip installed next to this python


def _subcommands() -> list[str]:
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command")
    return sorted(commands.choices)  # type: ignore[arg-type]


def _run(command: list[str]) -> subprocess.CompletedProcess[str]:
    # PYTHONWARNINGS=error also reaches the interpreter `kvrq worker` re-executes itself into.
    env = {**os.environ, "PYTHONWARNINGS": "error"}
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)


def test_kvrq_help_prints_no_warning() -> None:
    assert KVRQ.exists(), f"no console script at {KVRQ}: pip install -e '.[dev,dashboard]'"
    done = _run([str(KVRQ), "--help"])
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert "usage: kvrq" in done.stdout


@pytest.mark.parametrize("command", _subcommands())
def test_every_subcommand_help_prints_no_warning(command: str) -> None:
    done = _run([sys.executable, "-m", "worker.cli", command, "--help"])
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""


def test_the_dashboard_app_builds_without_warnings() -> None:
    """Flask, rq-dashboard and the JSON patch, with warnings as errors (no Redis needed to build it)."""
    code = "from worker.cli.dashboard import make_app; make_app('redis://127.0.0.1:1/0')"
    done = _run([sys.executable, "-c", code])
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""


def test_pyproject_uses_an_spdx_license_string() -> None:
    """A license table makes setuptools >= 77 print a deprecation warning on every `pip install`."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^license = "Apache-2.0"$', pyproject, re.M)
    assert re.search(r'^requires = \["setuptools>=77"\]', pyproject, re.M)
