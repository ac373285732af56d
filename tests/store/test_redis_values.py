"""Redis values sized for Redis: blocks cut into values of at most `value_bytes`, read straight into place.

Against a real redis-server (the fast path: resp.get_into on the pool's socket) and fakeredis
(the client's own pipeline), with a small `value_bytes` so the tiny test blocks (24 KB) span
several values.
"""

from __future__ import annotations

import json

import fakeredis
import numpy as np
import pytest
import redis
from safetensors.numpy import load as st_load

from store.manifest import _metadata_checksum, encode_manifest
from store.redis_store import MAX_VALUE_BYTES, RedisStore, split_parts
from store.resp import get_into
from store.stfile import encode, parse_header, view
from tests.store.conftest import assert_same_cache, make_cache, redis_value_keys, tiny_spec, tokens

VALUE_BYTES = 5_000


@pytest.fixture(params=[pytest.param("redis-server", marks=pytest.mark.integration), "fakeredis"])
def store(request: pytest.FixtureRequest) -> RedisStore:
    if request.param == "fakeredis":
        return RedisStore(fakeredis.FakeRedis(), tiny_spec(), value_bytes=VALUE_BYTES)
    url = request.getfixturevalue("redis_url")
    made = RedisStore(url, tiny_spec(), value_bytes=VALUE_BYTES)
    assert made._scatter  # our own pool: reads take the get_into path
    return made


def _values(store: RedisStore) -> dict[str, bytes]:
    client = store._client
    out = {}
    for key in redis_value_keys(client, store.prefix):
        value = client.get(key)
        assert isinstance(value, bytes)
        out[key] = value
    return out


def test_values_are_at_most_value_bytes_and_join_into_safetensors_blocks(store: RedisStore) -> None:
    cache = make_cache(store.spec, tokens(40))  # blocks of 16, 16 and 8 tokens
    store.put("a", cache)
    manifest = store.read_manifest("a")
    assert manifest is not None and manifest.part_bytes == VALUE_BYTES
    values = _values(store)
    assert values and all(len(v) <= VALUE_BYTES for v in values.values())
    expected = store.keys.of_refs("a", manifest.blocks, manifest.part_bytes)
    assert sorted(values) == sorted(expected) and len(expected) > len(manifest.blocks)
    for ref, block in zip(manifest.blocks, cache.blocks, strict=True):
        blob = b"".join(values[key] for key in store.keys.parts("a", ref.name, ref.nbytes, VALUE_BYTES))
        tensors = st_load(blob)
        assert np.array_equal(tensors["L2.v"], block.values[2])
    assert_same_cache(store.get("a"), cache)


def test_prefix_reads_and_block_reuse_with_multi_value_blocks(store: RedisStore) -> None:
    turn1 = tokens(40)
    store.put("a", make_cache(store.spec, turn1))
    turn2 = turn1 + tokens(30, seed=1)
    cache2 = make_cache(store.spec, turn2)
    store.put("a", cache2)
    assert store.stats()["blocks_reused"] == 2
    assert_same_cache(store.get("a"), cache2)
    assert_same_cache(store.get("a", prompt_tokens=turn2[:20] + [5]), make_cache(store.spec, turn2[:20]))
    manifest = store.read_manifest("a")
    assert manifest is not None
    assert sorted(_values(store)) == sorted(store.keys.of_refs("a", manifest.blocks, manifest.part_bytes))
    store.delete("a")
    assert _values(store) == {}


def _damage(store: RedisStore, how: str) -> None:
    manifest = store.read_manifest("a")
    assert manifest is not None
    ref = manifest.blocks[1]
    key = store.keys.parts("a", ref.name, ref.nbytes, manifest.part_bytes)[2]
    value = store._client.get(key)
    assert isinstance(value, bytes)
    if how == "missing":
        store._client.delete(key)
    elif how == "short":
        store._client.set(key, value[:-10])
    elif how == "flipped":
        store._client.set(key, value[:100] + bytes([value[100] ^ 1]) + value[101:])
    elif how == "wrong_type":
        store._client.delete(key)
        store._client.rpush(key, b"x")


@pytest.mark.parametrize(
    ("how", "reason"),
    [
        ("missing", "missing_block"),
        ("short", "truncated"),
        ("flipped", "checksum"),
        ("wrong_type", "backend_error"),
    ],
)
def test_a_damaged_value_is_a_counted_miss(store: RedisStore, how: str, reason: str) -> None:
    cache = make_cache(store.spec, tokens(40))
    store.put("a", cache)
    _damage(store, how)
    assert store.get("a") is None
    assert store.stats()[f"miss_{reason}"] == 1
    other = make_cache(store.spec, tokens(40, seed=1))  # other tokens: shares no block with the damage
    store.put("b", other)
    assert_same_cache(store.get("b"), other)  # the connection is still in step with the server


def _as_version_1(blob: bytes) -> bytes:
    """A manifest as version 1 wrote it: no fence, no part_bytes."""
    metadata, entries, start = parse_header(blob)
    metadata["version"] = "1"
    del metadata["fence"], metadata["part_bytes"]
    metadata["checksum"] = str(_metadata_checksum(metadata))
    header, buffers = encode([("token_ids", "I64", view(blob, entries["token_ids"], start))], metadata)
    return b"".join([header, *buffers])


@pytest.mark.integration
def test_a_version_1_cache_with_one_value_per_block_still_reads(redis_url: str) -> None:
    spec = tiny_spec()
    old_writer = RedisStore(redis_url, spec)
    old_writer.part_bytes = 0  # version 1: every block one value, whatever its size
    cache = make_cache(spec, tokens(40))
    old_writer.put("a", cache)
    manifest = old_writer.read_manifest("a")
    assert manifest is not None
    old_writer._client.set(old_writer.keys.manifest("a"), _as_version_1(encode_manifest(manifest)))
    store = RedisStore(redis_url, spec, value_bytes=VALUE_BYTES)
    reread = store.read_manifest("a")
    assert reread is not None and (reread.part_bytes, reread.fence) == (0, 0)
    assert_same_cache(store.get("a"), cache)
    turn2 = make_cache(spec, cache.token_ids + tokens(10, seed=1))
    store.put("a", turn2)  # cut the new way: the old single values are not reused, and are removed
    assert store.stats()["blocks_reused"] == 0
    assert_same_cache(store.get("a"), turn2)
    latest = store.read_manifest("a")
    assert latest is not None
    assert sorted(_values(store)) == sorted(store.keys.of_refs("a", latest.blocks, latest.part_bytes))


@pytest.mark.integration
def test_the_default_value_size_fits_redis(redis_url: str) -> None:
    """SmolLM2's 11.8 MB float32 blocks go out as three values under 4 MB."""
    from engine.core.spec import LayerSpec, ModelCacheSpec

    spec = ModelCacheSpec("smollm2-135m", 30, (LayerSpec("full"),) * 30, 3, 64, 64, "float32")
    store = RedisStore(redis_url, spec)
    cache = make_cache(spec, tokens(300))
    store.put("a", cache)
    sizes = sorted(len(v) for v in _values(store).values())
    assert max(sizes) <= MAX_VALUE_BYTES <= 4_000_000
    assert len(sizes) == 3 + 1  # block 1 (11.8 MB) in 3 values, the 44-token block 2 in one
    assert_same_cache(store.get("a"), cache)


def test_split_parts_cuts_byte_ranges_without_copying() -> None:
    array = np.arange(10, dtype=np.uint8)
    data: list[bytes | memoryview] = [b"head", array.data, b"", b"tail!"]
    values = split_parts(data, 4)
    joined = [b"".join(bytes(p) for p in value) for value in values]
    assert joined == [b"head", bytes(range(4)), bytes(range(4, 8)), b"\x08\x09ta", b"il!"]
    assert values[1][0].obj is array  # a view of the array, not a copy
    for part_bytes in (0, 100):  # no limit, or one larger than the blob: a single value
        (single,) = split_parts(data, part_bytes)
        assert b"".join(bytes(p) for p in single) == b"head" + bytes(range(10)) + b"tail!"


@pytest.mark.integration
def test_get_into_fills_buffers_and_reports_nil_and_other_sizes(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    pool = redis.ConnectionPool.from_url(redis_url)
    values = {f"k{i}".encode(): bytes([i]) * (1000 + i) for i in range(50)}
    client.mset(values)
    targets = {key: bytearray(len(value)) for key, value in values.items()}
    requests = [(key, memoryview(target)) for key, target in targets.items()]
    requests.append((b"absent", memoryview(bytearray(5))))
    requests.append((b"k1", memoryview(bytearray(3))))  # a value of another size
    seen: list[int] = []
    results = get_into(pool, requests, on_read=seen.append, window_bytes=4096)  # many windows
    assert results[:50] == [True] * 50
    assert results[50] is None and results[51] == values[b"k1"]
    assert seen == list(range(52))
    assert all(bytes(targets[key]) == value for key, value in values.items())


@pytest.mark.integration
def test_get_into_disconnects_after_an_error_reply(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    pool = redis.ConnectionPool.from_url(redis_url)
    client.set(b"good", b"x" * 10)
    client.rpush(b"list", b"x")
    with pytest.raises(redis.ResponseError):
        get_into(pool, [(b"list", memoryview(bytearray(1))), (b"good", memoryview(bytearray(10)))])
    target = bytearray(10)
    assert get_into(pool, [(b"good", memoryview(target))]) == [True]  # a fresh connection, in step
    assert bytes(target) == b"x" * 10


@pytest.mark.integration
def test_manifest_records_the_value_size(redis_url: str) -> None:
    store = RedisStore(redis_url, tiny_spec(), value_bytes=VALUE_BYTES)
    store.put("a", make_cache(store.spec, tokens(20)))
    raw = store._client.get(store.keys.manifest("a"))
    assert isinstance(raw, bytes)
    metadata, _entries, _start = parse_header(raw)
    assert metadata["part_bytes"] == str(VALUE_BYTES) and metadata["version"] == "5"
    assert len(json.loads(metadata["blocks"])) == 2
    with pytest.raises(ValueError):
        RedisStore(redis_url, tiny_spec(), value_bytes=10)
