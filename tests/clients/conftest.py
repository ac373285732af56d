"""Fixtures of the client-conformance suite: one stack per model for the whole session (the clients
themselves are driven by tests/clients/drivers.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.clients.models import write_ok_model
from tests.clients.stack import ClientStack

BUILTIN = "smollm2-135m"


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
