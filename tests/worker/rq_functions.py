"""Job functions and callbacks a plain `rq worker` and a kvrq worker import by dotted path
(the conformance suite, tests/worker/test_rq_conformance.py). Callbacks record what they were
given in Redis, where the test reads it."""

from __future__ import annotations

import json
import time
from typing import Any

from redis import Redis
from rq.job import Job


def calls_key(job_id: str) -> str:
    return f"conformance:callbacks:{job_id}"


def work(seconds: float = 0.0) -> dict[str, Any]:
    """A plain rq job: sleeps (long enough to time out or be stopped, when asked), returns a dict."""
    time.sleep(seconds)
    return {"slept": seconds}


def _record(connection: Redis, job: Job, kind: str, **details: Any) -> None:
    connection.rpush(
        calls_key(job.id), json.dumps({"kind": kind, "status": job.get_status(refresh=False), **details})
    )


def on_success(job: Job, connection: Redis, result: Any) -> None:
    _record(connection, job, "success", result_type=type(result).__name__)


def on_failure(job: Job, connection: Redis, exc_type: type, exc_value: BaseException, traceback: Any) -> None:
    _record(connection, job, "failure", exc_type=exc_type.__name__)


def on_stopped(job: Job, connection: Redis) -> None:
    _record(connection, job, "stopped")


def raising(job: Job, connection: Redis, *args: Any) -> None:
    _record(connection, job, "raising")
    raise RuntimeError("a callback that raises")


def sleeping(job: Job, connection: Redis, *args: Any) -> None:
    _record(connection, job, "sleeping")
    time.sleep(30)
