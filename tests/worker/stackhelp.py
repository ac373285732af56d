"""Helpers for tests of the long-running stack: README commands, HTTP, and the processes a command left."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from redis import Redis
from rq import Worker
from rq.serializers import JSONSerializer

from tests.worker.procs import ROOT, wait_for

README = ROOT / "README.md"


def readme_commands() -> list[str]:
    """Every shell command the README shows: lines of its bash blocks and its inline `code` spans."""
    text = README.read_text()
    lines = [
        line.strip()
        for block in re.findall(r"```bash\n(.*?)```", text, re.S)
        for line in block.splitlines()
        if line.strip()
    ]
    return lines + re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))


def readme_command(pattern: str) -> str:
    """The one README command that matches `pattern` (a regex), exactly as the README spells it."""
    found = sorted({c for c in readme_commands() if re.fullmatch(pattern, c)})
    assert len(found) == 1, f"expected one README command matching {pattern!r}, found {found}"
    return found[0]


def like_a_clone(tmp_path: Path) -> Path:
    """A directory where README commands run as in a fresh clone's root: the venv and the Procfile.

    The venv is the checkout's own (a symlink); state the stack writes (.kvrq/) stays in tmp_path.
    """
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    shutil.copy(ROOT / "Procfile", tmp_path / "Procfile")
    return tmp_path


def http_get(url: str, timeout: float = 30) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return int(response.status), response.read()
    except urllib.error.HTTPError as error:
        return int(error.code), error.read()


def serves(url: str) -> bool:
    try:
        return http_get(url, timeout=2)[0] == 200
    except OSError:
        return False


def descendants(pid: int) -> set[int]:
    """Every living process below `pid` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "?"


def rq_workers(redis_url: str) -> list[Worker]:
    return Worker.all(connection=Redis.from_url(redis_url), serializer=JSONSerializer)


class ShellCommand:
    """A README command run through bash in its own session, as a terminal runs it; Ctrl-C = SIGINT to it."""

    def __init__(self, command: str, cwd: Path, env: dict[str, str]) -> None:
        self.log_path = cwd / "command.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                ["bash", "-c", command],
                cwd=cwd,
                env={**os.environ, **env},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, condition, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
        wait_for(lambda: self.proc.poll() is not None or condition(), timeout, f"{what}:\n{self.log()}")
        assert self.proc.poll() is None, f"the command exited with {self.proc.returncode}:\n{self.log()}"

    def ctrl_c(self, timeout: float = 120) -> int:
        """SIGINT to the command's process group, like Ctrl-C in a terminal; its exit code."""
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running {timeout} s after Ctrl-C:\n{self.log()}") from None

    def kill_all(self) -> None:
        """Cleanup after a failed test: everything the command started."""
        for pid in [*descendants(self.proc.pid), self.proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(timeout=10)


def wait_gone(pids: set[int], timeout: float = 30) -> list[str]:
    """The command lines of those still running after `timeout` (empty when all stopped)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(running(pid) for pid in pids):
        time.sleep(0.2)
    return [f"{pid}: {command_line(pid)}" for pid in pids if running(pid)]
