"""Fixtures the worker's integration tests share: a redis-server of the test's own and a Producer on it.

Modules that need a module-scoped or persistent server define their own `redis_proc` (it wins).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from producer.client import Producer
from tests.worker.procs import RedisProcess


@pytest.fixture
def redis_proc(tmp_path: Path) -> Iterator[RedisProcess]:
    server = RedisProcess(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def producer(redis_proc: RedisProcess) -> Iterator[Producer]:
    with Producer(redis_proc.url) as p:
        yield p
