"""Progress display: log lines off a terminal, a tqdm bar on one."""

from __future__ import annotations

import pytest

from producer.batch.progress import Progress


def test_log_lines_carry_counts_tokens_per_second_and_eta() -> None:
    lines: list[str] = []
    progress = Progress("run-x", 10, done=2, bar=False, write=lines.append, interval_s=3600)
    progress.advance(True, tokens=40)
    progress.advance(False, ran=False)
    progress.set_in_flight(queued=3, running=2)
    progress.tick()
    assert lines == []  # the interval has not passed
    progress.tick(force=True)
    progress.close()
    assert len(lines) == 2
    assert "run-x: 4/10 lines (done 3, failed 1, queued 3, running 2)" in lines[0]
    assert "tok/s" in lines[0] and "eta " in lines[0] and "eta ?" not in lines[0]


def test_a_bar_on_request(capsys: pytest.CaptureFixture[str]) -> None:
    progress = Progress("run-y", 3, bar=True, write=lambda text: None)
    assert progress.uses_bar
    progress.advance(True, tokens=5)
    progress.tick()
    progress.close()
    err = capsys.readouterr().err
    assert "run-y" in err and "1/3" in err and "failed=0" in err


def test_notes_go_to_the_log_or_above_the_bar(capsys: pytest.CaptureFixture[str]) -> None:
    lines: list[str] = []
    Progress("run-z", 3, bar=False, write=lines.append).note("no live worker listens")
    assert lines == ["no live worker listens"]
    with_bar = Progress("run-w", 3, bar=True, write=lines.append)
    with_bar.note("no live worker listens on queue 'q'")
    with_bar.advance(True)
    with_bar.close()
    assert len(lines) == 1  # the bar's note did not go to the log
    err = capsys.readouterr().err
    assert "no live worker listens on queue 'q'\n" in err and "1/3" in err  # own line; the bar goes on
