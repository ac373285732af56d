"""Fixtures of the client-conformance suite: one stack per model for the whole session, the pinned
client programs, and an environment that keeps each client's state in the test's directory and its
traffic on loopback."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.clients.models import write_ok_model
from tests.clients.stack import ClientStack
from tests.conftest import in_ci

HERE = Path(__file__).resolve().parent
BUILTIN = "smollm2-135m"
#: A port nothing listens on: any request a client makes beyond loopback fails at once.
NO_NETWORK = "http://127.0.0.1:9"


def client_program(name: str) -> Path:
    """A pinned client: node_modules/.bin (npm ci --prefix tests/clients) or .venv-NAME/bin (pip)."""
    for path in (HERE / "node_modules" / ".bin" / name, HERE / f".venv-{name}" / "bin" / name):
        if path.exists():
            return path
    message = f"{name} is not installed under tests/clients (bash .ci/setup installs the pinned clients)"
    if in_ci():
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def isolated_env(home: Path, **extra: str) -> dict[str, str]:
    """The caller's PATH and locale, a fresh HOME (config, caches, sessions), telemetry off, and every
    non-loopback request sent to a dead proxy."""
    home.mkdir(parents=True, exist_ok=True)
    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "TERM", "LD_LIBRARY_PATH")}
    return {
        **keep,
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_DATA_HOME": str(home / ".local" / "share"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_STATE_HOME": str(home / ".local" / "state"),
        "HTTP_PROXY": NO_NETWORK,
        "HTTPS_PROXY": NO_NETWORK,
        "ALL_PROXY": NO_NETWORK,
        "http_proxy": NO_NETWORK,
        "https_proxy": NO_NETWORK,
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
        "DO_NOT_TRACK": "1",
        "CI": "true",
        **extra,
    }


@pytest.fixture(scope="session")
def builtin_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClientStack]:
    """kvrq serve + a worker on the builtin SmolLM2 (8K context): for clients whose prompt fits."""
    stack = ClientStack(BUILTIN, tmp_path_factory.mktemp("clients-builtin"))
    try:
        yield stack.start()
    finally:
        stack.stop()


@pytest.fixture(scope="session")
def long_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClientStack]:
    """kvrq serve + a worker on the 32K-context `OK` model: Claude Code's and Codex's defaults."""
    yield from _ok_model_stack(tmp_path_factory, "ok-32k", 32768)


@pytest.fixture(scope="session")
def short_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClientStack]:
    """kvrq serve + a worker on the `OK` model with the builtin's 8K context: opencode's default limits
    (32,000 output tokens) overflow it, the case where it looped on a 400."""
    yield from _ok_model_stack(tmp_path_factory, "ok-8k", 8192)


def _ok_model_stack(
    tmp_path_factory: pytest.TempPathFactory, name: str, context: int
) -> Iterator[ClientStack]:
    folder = write_ok_model(tmp_path_factory.mktemp("models") / name, context)
    stack = ClientStack(str(folder), tmp_path_factory.mktemp(f"clients-{name}"))
    try:
        yield stack.start()
    finally:
        stack.stop()
