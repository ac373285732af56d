"""A cache's conversation (AgentCache.conversation) lives in its manifest: written and read as one."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from store.backend import BlockBackend
from store.disk import DiskStore
from store.redis_store import RedisStore
from tests.store.conftest import make_cache, tiny_spec, tokens
from tests.store.test_corruption import Raw

RECORD = b'{"messages": [{"role": "user", "content": "hi"}]}'


@pytest.fixture(params=["disk", "redis-server"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BlockBackend]:
    opened: BlockBackend
    if request.param == "disk":
        opened = DiskStore(tmp_path / "store", tiny_spec())
    else:
        opened = RedisStore(request.getfixturevalue("redis_url"), tiny_spec())
    yield opened
    opened.close()


def test_the_conversation_comes_back_with_the_cache(store: BlockBackend) -> None:
    cache = dataclasses.replace(make_cache(tiny_spec(), tokens(40)), conversation=RECORD)
    store.put("talker", cache)
    loaded = store.get("talker")
    assert loaded is not None and loaded.conversation == RECORD
    assert loaded.token_ids == cache.token_ids
    prefix = store.get("talker", prompt_tokens=cache.token_ids[:20])
    assert prefix is not None and prefix.conversation == RECORD and prefix.n_tokens == 20


def test_a_cache_without_a_conversation_reads_as_none(store: BlockBackend) -> None:
    store.put("quiet", make_cache(tiny_spec(), tokens(40)))
    loaded = store.get("quiet")
    assert loaded is not None and loaded.conversation is None


def test_a_put_replaces_the_conversation_with_its_own(store: BlockBackend) -> None:
    first = dataclasses.replace(make_cache(tiny_spec(), tokens(20)), conversation=b"one")
    second = dataclasses.replace(make_cache(tiny_spec(), tokens(40)), conversation=b"two")
    store.put("agent", first)
    store.put("agent", second)
    loaded = store.get("agent")
    assert loaded is not None and loaded.conversation == b"two" and loaded.n_tokens == 40


def test_a_flipped_conversation_byte_is_a_counted_miss(
    backend_factory: Callable[..., DiskStore | RedisStore],
) -> None:
    store = backend_factory(tiny_spec())
    store.put("agent", dataclasses.replace(make_cache(tiny_spec(), tokens(40)), conversation=RECORD))
    raw = Raw(store, "agent")
    where = raw.manifest_location()
    blob = bytearray(raw.read(where))
    at = bytes(blob).rindex(b"hi")
    blob[at] ^= 0x01
    raw.write(where, bytes(blob))
    assert store.get("agent") is None
    assert store.stats()["miss_bad_manifest"] == 1
