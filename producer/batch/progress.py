"""Progress of a batch run: a tqdm bar on a terminal, plain periodic log lines anywhere else.

Log lines instead of a bar when stderr is not a TTY (CI logs, `nohup`), or when tqdm is not installed
(it is the optional `kvrq[batch]` extra): carriage-return bars make unreadable log files.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any


def _fmt_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


class Progress:
    """Counts finished lines and generated tokens of this client session and shows them."""

    def __init__(
        self,
        run_id: str,
        total: int,
        *,
        done: int = 0,
        failed: int = 0,
        bar: bool | None = None,
        write: Callable[[str], None] | None = None,
        interval_s: float = 10.0,
    ) -> None:
        self.run_id = run_id
        self.total = total
        self.done = done
        self.failed = failed
        self.queued = 0
        self.running = 0
        self.tokens = 0
        self.started = time.monotonic()
        self._lines_this_session = 0
        self._write = write or (lambda text: print(text, file=sys.stderr, flush=True))
        self._interval_s = interval_s
        self._last_log = self.started
        self._bar: Any = None
        if bar is None:
            bar = sys.stderr.isatty()
        if bar:
            self._bar = self._make_bar()

    def _make_bar(self) -> Any:
        try:
            from tqdm import tqdm
        except ImportError:
            return None
        return tqdm(
            total=self.total,
            initial=self.done + self.failed,
            unit="line",
            desc=self.run_id,
            dynamic_ncols=True,
            file=sys.stderr,
        )

    @property
    def uses_bar(self) -> bool:
        return self._bar is not None

    def tokens_per_s(self) -> float:
        elapsed = time.monotonic() - self.started
        return self.tokens / elapsed if elapsed > 0 else 0.0

    def eta_s(self) -> float | None:
        elapsed = time.monotonic() - self.started
        if self._lines_this_session == 0 or elapsed <= 0:
            return None
        remaining = self.total - self.done - self.failed
        return remaining * elapsed / self._lines_this_session

    def advance(self, ok: bool, tokens: int = 0, *, ran: bool = True) -> None:
        """One line finished (`ran` False for a bad input line, which says nothing about speed)."""
        if ok:
            self.done += 1
        else:
            self.failed += 1
        self.tokens += tokens
        if ran:
            self._lines_this_session += 1
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(self._postfix(), refresh=False)

    def note(self, text: str) -> None:
        """One line that is not a progress figure (e.g. that no worker listens): above the bar, if any."""
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        else:
            self._write(text)

    def set_in_flight(self, queued: int, running: int) -> None:
        self.queued = queued
        self.running = running

    def _postfix(self) -> dict[str, Any]:
        return {"done": self.done, "failed": self.failed, "tok/s": f"{self.tokens_per_s():.1f}"}

    def line(self) -> str:
        eta = self.eta_s()
        return (
            f"batch {self.run_id}: {self.done + self.failed}/{self.total} lines "
            f"(done {self.done}, failed {self.failed}, queued {self.queued}, running {self.running}), "
            f"{self.tokens_per_s():.1f} tok/s, elapsed {_fmt_duration(time.monotonic() - self.started)}, "
            f"eta {_fmt_duration(eta) if eta is not None else '?'}"
        )

    def tick(self, force: bool = False) -> None:
        """Refresh the bar, or write a log line when the interval has passed."""
        now = time.monotonic()
        if self._bar is not None:
            self._bar.set_postfix(self._postfix(), refresh=True)
            return
        if force or now - self._last_log >= self._interval_s:
            self._last_log = now
            self._write(self.line())

    def close(self) -> None:
        if self._bar is not None:
            self._bar.set_postfix(self._postfix(), refresh=True)
            self._bar.close()
            self._bar = None
        else:
            self._write(self.line())
