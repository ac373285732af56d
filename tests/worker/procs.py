"""Real processes for integration tests: benchmarks/procs.py's redis-server and `kvrq worker` (shared with
the benchmarks), with the tests' rule for a missing redis-server: skipped locally, failed under CI."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest

from benchmarks.procs import ROOT, WorkerProcess, running, wait_for
from tests.conftest import RedisServer

__all__ = [
    "ROOT",
    "RedisProcess",
    "WorkerProcess",
    "exits_cleanly",
    "module_redis",
    "running",
    "wait_for",
    "worker_per_queue",
]


#: The tests' redis-server (tests/conftest.py), under the name the benchmarks give it.
RedisProcess = RedisServer


@contextlib.contextmanager
def exits_cleanly(worker: WorkerProcess) -> Iterator[WorkerProcess]:
    """`worker` started; at the end it is sent SIGTERM and must drain and exit with 0 (its log shown)."""
    worker.start()
    try:
        yield worker
    finally:
        code = worker.terminate()
        assert code == 0, worker.log()


def module_redis(label: str, *, persistent: bool = False) -> Any:
    """A module-scoped fixture (assign it to the fixture's name): a redis-server of the test module's
    own, its data under a temporary folder redis-<label>, stopped after the module's last test."""

    @pytest.fixture(scope="module")
    def redis_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
        workdir = tmp_path_factory.mktemp(f"redis-{label}")
        with running(RedisProcess(workdir, persistent=persistent)) as server:
            yield server

    return redis_fixture


@contextlib.contextmanager
def worker_per_queue(
    redis_url: str,
    factory: Any,
    label: str,
    queues: Sequence[str],
    args: Sequence[str],
    extra: Mapping[str, Sequence[str]] | None = None,
) -> Iterator[list[WorkerProcess]]:
    """One started `kvrq worker` per queue (named kvrq-<label>-<queue>; `args`, then the queue's
    `extra` args), all killed on exit."""
    procs = [
        WorkerProcess(
            redis_url,
            factory.mktemp(f"{label}-{queue}"),
            name=f"kvrq-{label}-{queue}",
            queue=queue,
            args=[*args, *(extra or {}).get(queue, ())],
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
