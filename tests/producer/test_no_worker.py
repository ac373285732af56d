"""A real redis-server where no worker listens: the Producer and `kvrq generate` say so within seconds."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from producer.client import Producer, ResultTimeoutError
from tests.worker.procs import ROOT

pytestmark = pytest.mark.integration

NOTICE = "no live worker listens on queue 'kvrq'"


def test_result_warns_then_times_out_saying_no_worker_listens(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    with Producer(redis_url) as producer:
        handle = producer.submit({"prompt": "hi", "max_tokens": 4})
        with (
            caplog.at_level(logging.WARNING, logger="kvrq.producer"),
            pytest.raises(ResultTimeoutError) as timed_out,
        ):
            handle.result(timeout=6.5)
        assert handle.status() == "queued"  # the job keeps waiting for a worker
    assert NOTICE in str(timed_out.value) and handle.id in str(timed_out.value)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and NOTICE in warnings[0]


def test_generate_says_no_worker_listens(redis_url: str) -> None:
    command = [sys.executable, "-m", "worker.cli", "generate", "hi", "--redis", redis_url, "--timeout", "6.5"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    notices = [line for line in done.stderr.splitlines() if NOTICE in line]
    assert len(notices) == 2, done.stderr  # the notice after ~5 s, then the timeout's reason
    assert notices[0].startswith("(no live worker") and "did not end within 6.5 s" in notices[1]
