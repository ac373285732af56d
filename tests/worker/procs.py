"""Real processes for integration tests: benchmarks/procs.py's redis-server and `kvrq worker` (shared with
the benchmarks), with the tests' rule for a missing redis-server: skipped locally, failed under CI."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from benchmarks.procs import ROOT, WorkerProcess, wait_for
from tests.conftest import RedisServer

__all__ = ["ROOT", "RedisProcess", "WorkerProcess", "wait_for", "worker_per_queue"]


#: The tests' redis-server (tests/conftest.py), under the name the benchmarks give it.
RedisProcess = RedisServer


@contextlib.contextmanager
def worker_per_queue(
    redis_url: str, factory: Any, label: str, queues: Sequence[str], args: Sequence[str]
) -> Iterator[list[WorkerProcess]]:
    """One started `kvrq worker` per queue (named kvrq-<label>-<queue>), all killed on exit."""
    procs = [
        WorkerProcess(
            redis_url,
            factory.mktemp(f"{label}-{queue}"),
            name=f"kvrq-{label}-{queue}",
            queue=queue,
            args=args,
        )
        for queue in queues
    ]
    try:
        for proc in procs:
            proc.start()
        yield procs
    finally:
        for proc in procs:
            proc.stop()
