"""Shared fixtures: real redis-server processes on free loopback ports, and models."""

from __future__ import annotations

import os
import random
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.procs import RedisProcess, running

REAL_MODEL_FIXTURES = frozenset({"smollm2"})
REDIS_SERVER_HINT = "apt-get install redis-server; macOS: brew install redis"


def pytest_configure(config: pytest.Config) -> None:
    """Rerun pytest with OpenBLAS preloaded on Linux (10x faster model tests), once, before any test."""
    from engine.cpu.blas import blas_preload_env, ensure_fast_blas

    if blas_preload_env().get("LD_PRELOAD") != os.environ.get("LD_PRELOAD"):
        capture = config.pluginmanager.getplugin("capturemanager")
        if capture is not None:
            capture.stop_global_capturing()
        ensure_fast_blas()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reject_unmarked_real_model_tests(items)
    deselect_chaos(config, items)


def reject_unmarked_real_model_tests(items: list[pytest.Item]) -> None:
    """`-m "not slow"` must never load the real model: a test asking for it unmarked is an error."""
    unmarked = [
        item.nodeid
        for item in items
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ()))
        and item.get_closest_marker("slow") is None
    ]
    if unmarked:
        raise pytest.UsageError(
            "these tests load the real model but are not marked slow: " + ", ".join(unmarked)
        )


def deselect_chaos(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`chaos` tests (many kill -9 rounds, long outages, 1,000 fuzzed jobs: minutes) run only when asked
    for with `-m chaos`; otherwise they are deselected (not run, not counted as skipped)."""
    if "chaos" in (config.getoption("markexpr") or ""):
        return
    chaos = [item for item in items if item.get_closest_marker("chaos") is not None]
    if chaos:
        config.hook.pytest_deselected(items=chaos)
        items[:] = [item for item in items if item.get_closest_marker("chaos") is None]


def in_ci() -> bool:
    """CI sets CI=true and runs .ci/setup first: a tool missing there is a broken setup, not a skip."""
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_binary(name: str, install_hint: str) -> str:
    """The path of an external program the test needs: skipped locally when missing, failed under CI."""
    path = shutil.which(name)
    if path is not None:
        return path
    message = f"no {name} on PATH ({install_hint})"
    if in_ci():
        pytest.fail(f"{message}; CI runs .ci/setup, which installs it", pytrace=False)
    pytest.skip(message)


#: Ports handed to servers a test starts: below Linux's ephemeral range (32768-60999), so no client
#: connection's local port can take one between free_port() and the server's bind.
_SERVER_PORTS = range(20000, 32768)


def free_port() -> int:
    """A loopback port free now, outside the range the kernel gives outgoing connections."""
    for port in random.sample(_SERVER_PORTS, 64):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {_SERVER_PORTS}")


class RedisServer(RedisProcess):
    """benchmarks/procs.py's redis-server with the tests' rules: a missing binary is skipped locally and
    failed under CI, and the port is taken outside the ephemeral range (free_port above)."""

    def __init__(self, workdir: Path, *, persistent: bool = False) -> None:
        binary = require_binary("redis-server", REDIS_SERVER_HINT)
        super().__init__(workdir, persistent=persistent, binary=binary, port=free_port())


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One real redis-server for the session; tests flush what they use via `redis_url`."""
    with running(RedisServer(tmp_path_factory.mktemp("redis"))) as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    yield redis_server.url
    client.flushdb()
    client.close()


@pytest.fixture
def own_redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server this test alone may stop, kill or restart."""
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop(kill=True)


@pytest.fixture(scope="session")
def smollm2() -> tuple[object, object]:
    """The real builtin model (float32 on CPU), loaded once per session."""
    from engine.models.load import load_model

    return load_model("smollm2-135m")
