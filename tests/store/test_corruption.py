"""Every kind of bad stored data is detected, logged with agent id and reason, counted, and a miss."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from store.disk import MANIFEST, DiskStore
from store.errors import DAMAGE
from store.manifest import FORMAT_VERSION_NUMBER
from store.redis_store import RedisStore
from tests.store.conftest import assert_same_cache, make_cache, tiny_spec, tokens

Factory = Callable[..., DiskStore | RedisStore]
Location = Path | str  # a file of a DiskStore, a key of a RedisStore
AGENT = "victim-1"


class Raw:
    """Direct access to what a backend stored for one agent, to damage it."""

    def __init__(self, store: DiskStore | RedisStore, agent_id: str) -> None:
        self.store = store
        self.agent_id = agent_id

    def _redis(self) -> Any:
        assert isinstance(self.store, RedisStore)
        return self.store._client

    def manifest_location(self) -> Location:
        if isinstance(self.store, DiskStore):
            return self.store._agent_dir(self.agent_id) / MANIFEST
        return self.store.keys.manifest(self.agent_id)

    def block_locations(self) -> list[Location]:
        manifest = self.store.read_manifest(self.agent_id)
        assert manifest is not None
        if isinstance(self.store, DiskStore):
            blocks = self.store._agent_dir(self.agent_id) / "blocks"
            return [blocks / f"{ref.name}.safetensors" for ref in manifest.blocks]
        return [  # each tiny block is one value
            self.store.keys.parts(self.agent_id, ref.name, ref.nbytes, manifest.part_bytes)[0]
            for ref in manifest.blocks
        ]

    def read(self, location: Location) -> bytes:
        if isinstance(location, Path):
            return location.read_bytes()
        value = self._redis().get(location)
        assert isinstance(value, bytes)
        return value

    def write(self, location: Location, data: bytes) -> None:
        if isinstance(location, Path):
            location.write_bytes(data)
        else:
            self._redis().set(location, data)

    def remove(self, location: Location) -> None:
        if isinstance(location, Path):
            location.unlink()
        else:
            self._redis().delete(location)

    def make_unreadable(self, location: Location) -> None:
        """Put there what no read of a value can take: a directory (EISDIR) or a hash (WRONGTYPE)."""
        self.remove(location)
        if isinstance(location, Path):
            location.mkdir()
        else:
            self._redis().hset(location, "x", "y")


def _flip(data: bytes, index: int) -> bytes:
    return data[:index] + bytes([data[index] ^ 0x01]) + data[index + 1 :]


def _damage_block_data(raw: Raw) -> None:
    location = raw.block_locations()[1]
    data = raw.read(location)
    raw.write(location, _flip(data, len(data) - 100))


def _damage_block_header(raw: Raw) -> None:
    location = raw.block_locations()[0]
    data = raw.read(location)
    raw.write(location, data.replace(b'"n_tokens":"16"', b'"n_tokens":"17"', 1))


def _truncate_block(raw: Raw) -> None:
    location = raw.block_locations()[-1]
    raw.write(location, raw.read(location)[:-10])


def _remove_block(raw: Raw) -> None:
    raw.remove(raw.block_locations()[2])


def _damage_manifest_tokens(raw: Raw) -> None:
    location = raw.manifest_location()
    data = raw.read(location)
    raw.write(location, _flip(data, len(data) - 3))  # inside the token ids


def _damage_manifest_header(raw: Raw) -> None:
    location = raw.manifest_location()
    data = raw.read(location)
    raw.write(location, data.replace(b'"n_tokens":"40"', b'"n_tokens":"41"', 1))


def _truncate_manifest(raw: Raw) -> None:
    location = raw.manifest_location()
    raw.write(location, raw.read(location)[:50])


def _garbage_manifest(raw: Raw) -> None:
    raw.write(raw.manifest_location(), b"\x00\xff not safetensors at all")


def _empty_manifest(raw: Raw) -> None:
    raw.write(raw.manifest_location(), b"")


def _other_version(raw: Raw) -> None:
    location = raw.manifest_location()
    data = raw.read(location)
    old = f'"version":"{FORMAT_VERSION_NUMBER}"'.encode()
    new = f'"version":"{FORMAT_VERSION_NUMBER + 1}"'.encode()
    assert len(new) == len(old)  # the header keeps its length: only the version differs
    raw.write(location, data.replace(old, new, 1))


def _other_agents_manifest(raw: Raw) -> None:
    raw.store.put("intruder", make_cache(raw.store.spec, tokens(40, seed=3)))
    intruder = Raw(raw.store, "intruder")
    raw.write(raw.manifest_location(), raw.read(intruder.manifest_location()))


CASES = [
    (_damage_block_data, "checksum"),
    (_damage_block_header, "checksum"),
    (_truncate_block, "truncated"),
    (_remove_block, "missing_block"),
    (_damage_manifest_tokens, "bad_manifest"),
    (_damage_manifest_header, "bad_manifest"),
    (_truncate_manifest, "bad_manifest"),
    (_garbage_manifest, "bad_manifest"),
    (_empty_manifest, "bad_manifest"),
    (_other_version, "format_version"),
    (_other_agents_manifest, "agent_mismatch"),
]


@pytest.mark.parametrize(("damage", "reason"), CASES, ids=[c[0].__name__.strip("_") for c in CASES])
def test_damage_is_a_logged_counted_miss(
    backend_factory: Factory, damage: Callable[[Raw], None], reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    spec = tiny_spec()
    store = backend_factory(spec)
    cache = make_cache(spec, tokens(40))
    store.put(AGENT, cache)
    damage(Raw(store, AGENT))
    with caplog.at_level(logging.WARNING, logger="kvrq.store"):
        assert store.get(AGENT) is None
    stats = store.stats()
    assert stats[f"miss_{reason}"] == 1, stats
    assert stats["misses"] == 1 and stats["hits"] == 0
    # Damaged caches are deleted (a later put must not reuse their blocks); foreign ones are kept.
    assert stats["discarded"] == (1 if reason in DAMAGE else 0)
    assert any(AGENT in r.getMessage() and reason in r.getMessage() for r in caplog.records), caplog.text
    # A fresh put over the damage works, and leaves a readable cache.
    store.put(AGENT, cache)
    assert_same_cache(store.get(AGENT), cache)


@pytest.mark.parametrize("what", ["manifest", "block"])
def test_an_unreadable_value_is_a_logged_counted_miss(
    backend_factory: Factory, what: str, caplog: pytest.LogCaptureFixture
) -> None:
    spec = tiny_spec()
    store = backend_factory(spec)
    store.put(AGENT, make_cache(spec, tokens(40)))
    raw = Raw(store, AGENT)
    raw.make_unreadable(raw.manifest_location() if what == "manifest" else raw.block_locations()[0])
    with caplog.at_level(logging.WARNING, logger="kvrq.store"):
        assert store.get(AGENT) is None
    assert store.stats()["miss_backend_error"] == 1
    assert AGENT in caplog.text


def test_unreachable_redis_is_a_miss_not_a_crash() -> None:
    from tests.conftest import free_port

    store = RedisStore(f"redis://127.0.0.1:{free_port()}/0", tiny_spec())
    assert store.get(AGENT) is None
    assert store.stats()["miss_backend_error"] == 1
    store.close()


def test_manifest_metadata_checksum_covers_every_field(backend_factory: Factory) -> None:
    """Rewriting any field consistently (valid JSON, valid header) is still caught."""
    spec = tiny_spec()
    store = backend_factory(spec)
    store.put(AGENT, make_cache(spec, tokens(40)))
    raw = Raw(store, AGENT)
    location = raw.manifest_location()
    data = raw.read(location)
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_len])
    header["__metadata__"]["created"] = "0.0"
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (header_len - len(text))
    assert len(text) == header_len
    raw.write(location, data[:8] + text + data[8 + header_len :])
    assert store.get(AGENT) is None
    assert store.stats()["miss_bad_manifest"] == 1


def test_damaged_cache_is_not_deleted_once_a_writer_replaced_it(backend_factory: Factory) -> None:
    spec = tiny_spec()
    store = backend_factory(spec)
    store.put(AGENT, make_cache(spec, tokens(40)))
    seen = Raw(store, AGENT).read(Raw(store, AGENT).manifest_location())
    fresh = make_cache(spec, tokens(40, seed=4))
    store.put(AGENT, fresh)  # a writer replaced the manifest after `seen` was read
    assert store._remove(store._handle(AGENT), only_if=seen) is False
    assert_same_cache(store.get(AGENT), fresh)
    current = Raw(store, AGENT).read(Raw(store, AGENT).manifest_location())
    assert store._remove(store._handle(AGENT), only_if=current) is True
    assert store.get(AGENT) is None


def test_an_unforeseen_error_while_reading_is_a_miss_with_a_traceback(
    backend_factory: Factory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from store import policy as policy_module

    spec = tiny_spec()
    store = backend_factory(spec)
    store.put(AGENT, make_cache(spec, tokens(40)))

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug in decoding")

    monkeypatch.setattr(policy_module, "decode_block", broken)
    with caplog.at_level(logging.WARNING, logger="kvrq.store"):
        assert store.get(AGENT) is None
    assert store.stats()["miss_unexpected_error"] == 1
    assert "a bug in decoding" in caplog.text and "Traceback" in caplog.text
    monkeypatch.undo()
    assert store.get(AGENT) is not None  # not treated as damage: the cache was kept
