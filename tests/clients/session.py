"""One client session against a ClientStack: run the client's commands as a user would, then check
what every conformance test checks (issue 42 items 6 and 8): each command exited 0, every request
got a 2xx, and every request after the first resumed >= 95% of what it shares with an earlier one."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from tests.clients.proxy import Exchange
from tests.clients.reuse import Turn, session_turns, table
from tests.clients.stack import ClientStack


class Session:
    """The requests and jobs from its creation on belong to it (tests of one stack run one at a time)."""

    def __init__(self, stack: ClientStack, workdir: Path) -> None:
        assert stack.proxy is not None
        self.stack = stack
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.started = time.time()
        self.mark = stack.proxy.mark()

    def run(self, argv: Sequence[str | Path], env: dict[str, str], timeout: float = 300) -> str:
        """Run one client command in the session's directory; its stdout, once it exited 0."""
        try:
            done = subprocess.run(
                [str(a) for a in argv],
                env=env,
                cwd=self.workdir,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(
                f"{argv[0]} still running after {timeout} s, {len(self.exchanges())} requests:\n"
                + self.requests_brief()
            ) from exc
        assert done.returncode == 0, (
            f"{Path(str(argv[0])).name} exited {done.returncode}\nstdout: {done.stdout[-3000:]}\n"
            f"stderr: {done.stderr[-3000:]}\nrequests:\n{self.requests_brief()}"
        )
        return done.stdout

    def exchanges(self) -> list[Exchange]:
        assert self.stack.proxy is not None
        return self.stack.proxy.since(self.mark)

    def requests_brief(self) -> str:
        return "\n".join(exchange.brief() for exchange in self.exchanges())

    def turns(self) -> list[Turn]:
        return session_turns(self.stack.finished_jobs(self.started), self.stack.model)

    def check(self, min_jobs: int = 3) -> list[Turn]:
        """Every request 2xx; at least `min_jobs` jobs; each after the first resumed enough."""
        failed = [exchange for exchange in self.exchanges() if not exchange.ok]
        assert not failed, "requests refused:\n" + "\n".join(exchange.brief() for exchange in failed)
        turns = self.turns()
        assert len(turns) >= min_jobs, f"{len(turns)} jobs ran:\n{self.requests_brief()}"
        short = [turn for turn in turns[1:] if not turn.resumed_enough]
        assert not short, f"requests that resumed < 95% of what they share:\n{table(turns)}"
        ignored = sorted(
            {e.headers["x-kvrq-ignored"] for e in self.exchanges() if "x-kvrq-ignored" in e.headers}
        )
        print(f"{table(turns)}\nx-kvrq-ignored: {ignored}")  # shown by pytest -rA: the docs' table
        return turns
