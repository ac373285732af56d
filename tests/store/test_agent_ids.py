"""Agent ids are validated, and hostile ones can never reach the filesystem or a foreign key (on every
backend)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from producer.wire.ids import MAX_AGENT_ID_LENGTH, InvalidAgentIdError, validate_agent_id
from store.agent_ids import agent_key
from store.disk import DiskStore
from store.hot import HotTierStore
from store.redis_store import RedisStore
from tests.store.conftest import make_cache, tiny_spec, tokens

HOSTILE = [
    "../../etc/passwd",
    "../x",
    "/etc/passwd",
    "a/b",
    "a\\b",
    "a\x00b",
    "..",
    ".",
    ".hidden",
    "",
    "a b",
    "a\nb",
    "é",
    "x" * (MAX_AGENT_ID_LENGTH + 1),
    "~root",
    "$(rm -rf /)",
    "*",
]


@pytest.mark.parametrize("agent_id", HOSTILE)
def test_hostile_ids_are_rejected(agent_id: str) -> None:
    with pytest.raises(InvalidAgentIdError):
        validate_agent_id(agent_id)


@pytest.mark.parametrize("agent_id", ["a", "agent-1", "user:42:agent", "A.b_c@d+e=f", "9" * 200])
def test_ordinary_ids_are_accepted(agent_id: str) -> None:
    assert validate_agent_id(agent_id) == agent_id
    key = agent_key(agent_id)
    assert len(key) == 40 and set(key) <= set("0123456789abcdef")


def test_non_strings_are_rejected() -> None:
    for value in (None, 42, b"agent"):
        with pytest.raises(InvalidAgentIdError):
            validate_agent_id(value)


def test_ids_differing_in_case_get_different_keys() -> None:
    assert agent_key("Agent") != agent_key("agent")


@pytest.mark.parametrize("agent_id", HOSTILE)
def test_every_store_operation_refuses_hostile_ids_and_writes_nothing_outside(
    agent_id: str, backend_factory: Callable[..., DiskStore | RedisStore], tmp_path: Path
) -> None:
    spec = tiny_spec()
    backend = backend_factory(spec)
    store = HotTierStore(backend, 1 << 20)
    cache = make_cache(spec, tokens(20))

    def stored() -> set[object]:
        """Every file under the test's directory, and every Redis key."""
        keys = set(backend._client.keys()) if isinstance(backend, RedisStore) else set()
        return {*tmp_path.rglob("*"), *keys}

    before = stored()
    for call in (
        lambda: store.put(agent_id, cache),
        lambda: store.get(agent_id),
        lambda: store.delete(agent_id),
        lambda: store.info(agent_id),
        lambda: store.backend.put(agent_id, cache),
        lambda: store.backend.get(agent_id),
        lambda: store.backend.delete(agent_id),
    ):
        with pytest.raises(InvalidAgentIdError):
            call()
    store.close()
    assert stored() == before


def test_files_live_only_under_hashed_names(tmp_path: Path) -> None:
    spec = tiny_spec()
    store = DiskStore(tmp_path / "s", spec)
    store.put("user:1", make_cache(spec, tokens(40)))
    for path in (tmp_path / "s").rglob("*"):
        assert "user" not in str(path.relative_to(tmp_path))
        assert os.path.realpath(path).startswith(os.path.realpath(tmp_path / "s"))
    assert store.list() == ["user:1"]
