"""`kvrq batch run|status|cancel` through argparse, on a real redis-server with a fake worker thread."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from producer.batch.cli import main
from producer.batch.run import derive_run_id
from tests.batch.fakes import FakeRqWorkerThread, read_output
from tests.batch.test_driver import line

pytestmark = pytest.mark.integration


def test_run_status_and_cancel_commands(
    tmp_path: Path, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join([line(f"r{i}", agent=f"a{i % 3}") for i in range(9)] + ["{bad"]) + "\n")
    out = tmp_path / "out.jsonl"
    with FakeRqWorkerThread(redis_url) as worker:
        code = main(
            ["batch", "run", str(source), "-o", str(out), "--redis", redis_url, "--progress", "log", "--json"]
        )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    summary = json.loads(captured.out)
    assert summary["done"] == 9 and summary["failed"] == 1 and len(worker.done) == 9
    assert "10/10 lines (done 9, failed 1" in captured.err  # the plain log line off a TTY
    assert len(read_output(out)) == 10

    assert main(["batch", "status", summary["run_id"], "--redis", redis_url]) == 0
    text = capsys.readouterr().out
    assert f"run       {summary['run_id']} (done)" in text and "finished 9" in text
    assert main(["batch", "status", "--redis", redis_url, "--json"]) == 0
    assert [r["run_id"] for r in json.loads(capsys.readouterr().out)] == [summary["run_id"]]

    # a rerun of a finished run has nothing to do
    assert main(["batch", "run", str(source), "-o", str(out), "--redis", redis_url, "--progress", "log"]) == 0
    assert "0 enqueued" in capsys.readouterr().out and len(read_output(out)) == 10

    assert main(["batch", "cancel", "no-such-run", "--redis", redis_url]) == 1
    assert main(["batch", "status", "no-such-run", "--redis", redis_url]) == 1
    assert main(["batch", "cancel", derive_run_id(source.read_bytes(), "kvrq"), "--redis", redis_url]) == 0


def test_run_reports_a_missing_input_file(
    tmp_path: Path, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(["batch", "run", str(tmp_path / "nope.jsonl"), "-o", str(tmp_path / "o"), "--redis", redis_url])
        == 2
    )
    assert "nope.jsonl" in capsys.readouterr().err
