"""`kvrq batch run` against a real redis-server where no worker listens: it says so within seconds.

No worker process, no model: the client alone, as a user who forgot to start `kvrq worker` sees it.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.worker.procs import ROOT

pytestmark = pytest.mark.integration

NOTICE = "no live worker listens on queue 'kvrq'"


def test_batch_run_says_no_worker_listens_and_keeps_waiting(redis_url: str, tmp_path: Path) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    line = {"custom_id": "t1", "method": "POST", "url": "/v1/chat/completions", "body": body}
    (tmp_path / "in.jsonl").write_text(json.dumps(line) + "\n")
    command = [sys.executable, "-m", "worker.cli", "batch", "run", str(tmp_path / "in.jsonl")]
    command += ["-o", str(tmp_path / "out.jsonl"), "--redis", redis_url, "--progress", "log"]
    # Ctrl-C as a terminal delivers it: a runner that started this suite in the background (`cmd &` in
    # a shell without job control) hands its children SIGINT ignored, and so would the client inherit.
    client = subprocess.Popen(
        command,
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert client.stderr is not None
    lines: list[tuple[float, str]] = []
    started = time.monotonic()
    reader = threading.Thread(
        target=lambda: lines.extend((time.monotonic() - started, text) for text in client.stderr or ()),
        daemon=True,
    )
    reader.start()
    try:
        # Ctrl-C once the client waits (its notice printed), not while it may still be importing
        # on a loaded machine: the interrupt under test is the one a user gives a waiting run.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(NOTICE in text for _, text in lines):
            time.sleep(0.1)
        assert client.poll() is None, f"the client must keep waiting for a worker: {lines}"
        assert any(NOTICE in text for _, text in lines), f"no notice within 60 s: {lines}"
        client.send_signal(signal.SIGINT)
        try:  # interrupted: the run can be resumed
            assert client.wait(timeout=60) == 130, lines
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 60 s after Ctrl-C; its stderr: {lines}")
    finally:
        if client.poll() is None:
            client.kill()
    reader.join(timeout=5)
    notices = [(at, text) for at, text in lines if NOTICE in text]
    assert len(notices) == 1, lines  # once, not on every poll
    assert 4 <= notices[0][0] < 15  # after the first few seconds of waiting, not at once
    assert notices[0][1].startswith("batch batch-")
