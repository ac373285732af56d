"""RedisStore against a real redis-server (the conftest fixture): zero-copy sends, TTL, prefixes."""

from __future__ import annotations

import numpy as np
import pytest
import redis
from safetensors.numpy import load as st_load

from engine.kv.quantized import dequantize_cache
from store import redis_store
from store.factory import open_store
from store.redis_store import RedisStore
from tests.conftest import RedisServer
from tests.store.conftest import assert_same_cache, make_cache, redis_value_keys, tiny_spec, tokens

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("quantization", ["none", "q8", "q4"])
def test_round_trip_through_the_scatter_packer(redis_url: str, quantization: str) -> None:
    spec = tiny_spec()
    store = RedisStore(redis_url, spec, quantization=quantization, group_size=32)
    assert store._scatter
    cache = make_cache(spec, tokens(200))
    store.put("a", cache)
    got = store.get("a")
    if quantization == "none":
        assert_same_cache(got, cache)
    else:
        assert got is not None and got.token_ids == cache.token_ids
        got = dequantize_cache(got)  # blocks come back as stored; the engine converts them once
        assert np.allclose(got.blocks[-1].values[2], cache.blocks[-1].values[2], atol=0.15)
    store.close()


def test_pipeline_flushes_in_chunks(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(redis_store, "_PIPELINE_BYTES", 100_000)  # a flush every ~2 blocks
    spec = tiny_spec()
    store = RedisStore(redis_url, spec)
    cache = make_cache(spec, tokens(150))
    store.put("a", cache)
    assert_same_cache(store.get("a"), cache)


def test_values_open_with_the_safetensors_library(redis_url: str) -> None:
    spec = tiny_spec("float16")
    store = RedisStore(redis_url, spec)
    cache = make_cache(spec, tokens(40))
    store.put("a", cache)
    client = redis.Redis.from_url(redis_url)
    manifest = store.read_manifest("a")
    assert manifest is not None

    def value(key: str) -> bytes:
        data = client.get(key)
        assert isinstance(data, bytes)
        return data

    assert st_load(value(store.keys.manifest("a")))["token_ids"].tolist() == cache.token_ids
    for ref, block in zip(manifest.blocks, cache.blocks, strict=True):
        tensors = st_load(value(store.keys.parts("a", ref.name, ref.nbytes, manifest.part_bytes)[0]))
        assert np.array_equal(tensors["L1.v"], block.values[1]) and tensors["L1.v"].dtype == np.float16


def test_committed_keys_are_permanent_and_uncommitted_ones_expire(redis_url: str) -> None:
    spec = tiny_spec()
    store = RedisStore(redis_url, spec)
    store.put("a", make_cache(spec, tokens(40)))
    client = redis.Redis.from_url(redis_url)
    keys = [*redis_value_keys(client, "kvrq:cache:"), store.keys.manifest("a")]
    assert len(keys) == 4 and all(client.ttl(k) == -1 for k in keys)  # 2 shared + 1 own block
    plan = store.plan_write("b", make_cache(spec, tokens(20, seed=1)), None)
    store._write_blocks("b", plan)  # a writer that dies before committing
    for block in plan.new_blocks:
        key = store.keys.parts("b", block.name, block.encoded.nbytes, store.part_bytes)[0]
        assert 0 < client.pttl(key) <= redis_store.PENDING_TTL_MS


def test_ttl_is_set_on_every_key(redis_url: str) -> None:
    """Every key of an agent expires within ttl_s (that a get extends it and an unused agent goes is
    tests/store/test_pins.py's, on disk and Redis)."""
    spec = tiny_spec()
    store = RedisStore(redis_url, spec, ttl_s=2)
    store.put("a", make_cache(spec, tokens(40)))
    store.put("b", make_cache(spec, tokens(40, seed=1)))
    client = redis.Redis.from_url(redis_url)
    assert all(0 < client.ttl(k) <= 2 for k in client.scan_iter(match="kvrq:cache:*:*"))


def test_prefixes_separate_stores(redis_url: str) -> None:
    spec = tiny_spec()
    one = RedisStore(redis_url, spec, prefix="one:")
    two = RedisStore(redis_url, spec, prefix="two:")
    one.put("a", make_cache(spec, tokens(20)))
    assert two.get("a") is None and two.list() == []
    client = redis.Redis.from_url(redis_url)
    assert all(bytes(k).startswith(b"one:") for k in client.scan_iter(match="*"))


def test_redis_going_away_is_a_miss_and_a_counted_write_error(own_redis_server: RedisServer) -> None:
    spec = tiny_spec()
    store = open_store(own_redis_server.url, spec, hot_tier_bytes=0)
    cache = make_cache(spec, tokens(40))
    store.put("a", cache)
    store.flush()
    own_redis_server.stop(kill=True)
    assert store.get("a") is None
    assert store.stats()["miss_backend_error"] == 1
    store.put("b", cache)  # write-behind: logged and counted, the worker carries on
    store.flush()
    assert store.stats()["write_errors"] == 1
    own_redis_server.start()  # same port, empty: the store reconnects
    store.put("c", cache)
    store.flush()
    assert_same_cache(store.get("c"), cache)
    store.close()
