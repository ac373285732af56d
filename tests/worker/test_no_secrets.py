"""Places that show a Redis URL show it without its password: CLI help, worker logs, store errors."""

from __future__ import annotations

import argparse
import logging

import pytest

from store.factory import open_backend
from tests.worker.fakes import SPEC
from worker import process
from worker.cli.main import build_parser

SECRET = "n0t-for-logs"
URL = f"redis://kvrq:{SECRET}@127.0.0.1:1/0"


def every_parser(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += every_parser(sub)
    return found


def test_no_help_text_shows_the_redis_url_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVRQ_REDIS_URL", URL)
    parsers = every_parser(build_parser())
    assert len(parsers) > 10  # kvrq, its commands and the batch subcommands
    for parser in parsers:
        assert SECRET not in parser.format_help(), parser.prog


def test_worker_waiting_for_redis_logs_the_url_without_password(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    class Stop(Exception):
        pass

    def no_sleep(seconds: float) -> None:
        raise Stop

    monkeypatch.setattr(process.time, "sleep", no_sleep)
    with caplog.at_level(logging.WARNING, logger="kvrq.worker"), pytest.raises(Stop):
        process.wait_for_redis(URL)
    assert "Redis at redis://kvrq:***@127.0.0.1:1/0 unreachable" in caplog.text
    assert SECRET not in caplog.text


def test_a_mistyped_store_uri_is_not_echoed_with_its_password() -> None:
    with pytest.raises(ValueError) as info:
        open_backend(f"reddis://:{SECRET}@127.0.0.1:6379/0", SPEC)
    assert "unknown store URI 'reddis://***@127.0.0.1:6379/0'" in str(info.value)
    assert SECRET not in str(info.value)


def test_a_client_command_that_cannot_reach_redis_says_so_in_one_line_without_the_password() -> None:
    import subprocess
    import sys

    from tests.conftest import free_port

    url = f"redis://:hunter2@127.0.0.1:{free_port()}/0"
    done = subprocess.run(
        [sys.executable, "-m", "worker.cli", "status", "--redis", url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert "Traceback" not in done.stderr and "hunter2" not in done.stderr + done.stdout
    assert done.stderr.startswith("kvrq: Redis at redis://***@127.0.0.1:")
    assert "Connection refused" in done.stderr and done.stderr.count("\n") == 1
