"""Round trips, block reuse, prefix reads, delete/list/info: every backend, through one interface."""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable

import numpy as np
import pytest

from engine.core.errors import CacheMismatchError
from engine.kv.quantized import dequantize_cache
from store.commit import NewBlock, WritePlan
from store.disk import MANIFEST, DiskStore
from store.redis_store import RedisStore
from tests.store.conftest import assert_same_cache, make_cache, redis_value_keys, tiny_spec, tokens

Factory = Callable[..., DiskStore | RedisStore]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("n_tokens", [1, 16, 40])
def test_round_trip_is_exact(backend_factory: Factory, dtype: str, n_tokens: int) -> None:
    spec = tiny_spec(dtype)
    store = backend_factory(spec)
    cache = make_cache(spec, tokens(n_tokens))
    store.put("a1", cache)
    assert_same_cache(store.get("a1"), cache)
    stats = store.stats()
    assert (stats["puts"], stats["hits"], stats["misses"]) == (1, 1, 0)


def test_absent_agent_is_a_plain_miss(backend_factory: Factory) -> None:
    store = backend_factory(tiny_spec())
    assert store.get("nobody") is None
    assert store.stats()["miss_absent"] == 1


def test_second_turn_writes_only_new_and_changed_blocks(backend_factory: Factory) -> None:
    spec = tiny_spec()
    store = backend_factory(spec)
    turn1 = tokens(40)  # blocks: 16 + 16 + 8
    store.put("a1", make_cache(spec, turn1))
    turn2 = turn1 + tokens(30, seed=1)  # 70 tokens: 16 + 16 + 16 + 16 + 6
    cache2 = make_cache(spec, turn2)
    store.put("a1", cache2)
    stats = store.stats()
    assert stats["blocks_written"] == 3 + 3  # turn 2 rewrote the old partial block and added two
    assert stats["blocks_reused"] == 2
    assert_same_cache(store.get("a1"), cache2)


def test_edited_conversation_reuses_only_the_common_prefix(backend_factory: Factory) -> None:
    spec = tiny_spec()
    store = backend_factory(spec)
    old = tokens(60)
    store.put("a1", make_cache(spec, old))
    edited = old[:20] + [7, 7, 7] + old[23:]
    store.put("a1", make_cache(spec, edited))
    stats = store.stats()
    assert stats["blocks_reused"] == 1  # only the first block (tokens 0..15) is still valid
    assert_same_cache(store.get("a1"), make_cache(spec, edited))


def test_get_for_a_prompt_returns_only_the_shared_prefix(backend_factory: Factory) -> None:
    spec = tiny_spec()
    store = backend_factory(spec)
    stored = tokens(60)
    store.put("a1", make_cache(spec, stored))
    prompt = stored[:37] + [1, 2, 3]  # diverges inside the third block
    got = store.get("a1", prompt_tokens=prompt)
    assert_same_cache(got, make_cache(spec, stored[:37]))
    read = store.stats()["bytes_read"]
    full = store.get("a1")
    assert full is not None and full.n_tokens == 60
    assert store.stats()["bytes_read"] - read > read  # the prefix read skipped the fourth block
    longer = stored + tokens(5, seed=9)
    got_all = store.get("a1", prompt_tokens=longer)
    assert got_all is not None and got_all.token_ids == stored
    assert store.get("a1", prompt_tokens=[stored[0] + 1, *stored[1:]]) is None
    assert store.stats()["miss_no_common_prefix"] == 1


def test_delete_list_info(backend_factory: Factory) -> None:
    spec = tiny_spec()
    store = backend_factory(spec)
    assert store.list() == [] and store.info("a1") is None
    store.put("a1", make_cache(spec, tokens(40)))
    store.put("b:2", make_cache(spec, tokens(5)))
    assert store.list() == ["a1", "b:2"]
    info = store.info("a1")
    assert info is not None
    assert (info.n_tokens, info.n_blocks, info.quantization) == (40, 3, "none")
    assert info.nbytes > make_cache(spec, tokens(40)).nbytes
    assert store.delete("a1") is True
    assert store.delete("a1") is False
    assert store.get("a1") is None
    assert store.list() == ["b:2"]


def test_put_refuses_a_cache_of_another_spec(backend_factory: Factory) -> None:
    store = backend_factory(tiny_spec())
    other = make_cache(tiny_spec(name="other"), tokens(20))
    with pytest.raises(CacheMismatchError):
        store.put("a1", other)
    assert store.list() == []
    if isinstance(store, DiskStore):
        assert not list((store.root / "agents").iterdir())


def test_cache_of_another_spec_is_a_miss(backend_factory: Factory) -> None:
    spec = tiny_spec()
    backend_factory(tiny_spec(layers=4)).put("a1", make_cache(tiny_spec(layers=4), tokens(20)))
    store = backend_factory(spec)
    assert store.get("a1") is None
    assert store.stats()["miss_spec_mismatch"] == 1
    store.put("a1", make_cache(spec, tokens(20)))  # and it can be replaced
    assert store.get("a1") is not None


def test_reading_and_replacing_with_another_quantization(backend_factory: Factory) -> None:
    spec = tiny_spec()
    cache = make_cache(spec, tokens(40))
    backend_factory(spec, quantization="q8").put("a1", cache)
    plain = backend_factory(spec)  # configured for "none": still reads the q8 cache it finds
    got = plain.get("a1")
    assert got is not None and got.token_ids == cache.token_ids
    assert got.quantization == (8, 64)  # as stored: the engine converts it once for its pool
    assert np.allclose(dequantize_cache(got).blocks[0].keys[0], cache.blocks[0].keys[0], atol=0.02)
    plain.put("a1", cache)
    assert plain.stats()["blocks_reused"] == 0  # q8 blocks are never reused as `none` ones
    assert_same_cache(plain.get("a1"), cache)


def test_no_garbage_is_left_behind(backend_factory: Factory) -> None:
    spec = tiny_spec()
    store = backend_factory(spec)
    for turn in range(1, 5):
        store.put("a1", make_cache(spec, tokens(20 * turn)))
    store.put("a1", make_cache(spec, tokens(10, seed=5)))
    final = make_cache(spec, tokens(10, seed=5))
    assert_same_cache(store.get("a1"), final)
    assert _stored_block_count(store) == 1
    store.delete("a1")
    assert _stored_block_count(store) == 0


def test_a_put_whose_block_writes_fail_keeps_the_cache_and_leaves_no_garbage(
    backend_factory: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A put-many that fails once its blocks went out (a full store, a lost connection) fails the put;
    the stored cache is untouched, and nothing the failed put wrote outlives the next put (Redis drops
    it at once; disk's are garbage the next put collects under the agent's lock)."""
    spec = tiny_spec()
    store = backend_factory(spec)
    first = make_cache(spec, tokens(20))  # a full (shared) block and a partial (own) one
    store.put("a1", first)
    write = store._write_blocks

    def fails_after_writing(agent_id: str, plan: WritePlan) -> list[NewBlock]:
        write(agent_id, plan)
        raise OSError(errno.EIO, "the connection dropped after the blocks went out")

    monkeypatch.setattr(store, "_write_blocks", fails_after_writing)
    with pytest.raises(OSError, match="dropped"):
        store.put("a1", make_cache(spec, tokens(60, seed=2)))
    assert_same_cache(store.get("a1"), first)
    if isinstance(store, RedisStore):
        assert _stored_block_count(store) == 2
    monkeypatch.undo()
    store.put("a1", first)
    assert _stored_block_count(store) == 2
    assert_same_cache(store.get("a1"), first)


def _stored_block_count(store: DiskStore | RedisStore) -> int:
    if isinstance(store, DiskStore):
        return sum(1 for p in store.root.rglob("*") if p.is_file() and p.parent.name == "blocks")
    return len(redis_value_keys(store._client, store.prefix))


def test_empty_cache_round_trips(backend_factory: Factory) -> None:
    spec = tiny_spec()
    store = backend_factory(spec)
    store.put("a1", make_cache(spec, []))
    got = store.get("a1")
    assert got is not None and got.token_ids == [] and got.blocks == []


def test_every_store_satisfies_the_protocol(backend_factory: Factory, tmp_path: object) -> None:
    from store import CacheStore, open_store

    backend = backend_factory(tiny_spec())
    assert isinstance(backend, CacheStore)
    hot = open_store(f"disk:{tmp_path}/hot", tiny_spec())
    assert isinstance(hot, CacheStore)
    hot.close()


def set_last_used(store: DiskStore | RedisStore, agent_id: str, when: float) -> None:
    """Record `when` as the agent's last use where each backend keeps it (disk: its manifest's
    mtime; Redis: its score in the index)."""
    if isinstance(store, DiskStore):
        os.utime(store._agent_dir(agent_id) / MANIFEST, (when, when))
    else:
        store._client.zadd(store.keys.index, {agent_id: when}, xx=True)


def test_get_refreshes_last_used(backend_factory: Factory) -> None:
    spec = tiny_spec()
    store = backend_factory(spec)
    store.put("a", make_cache(spec, tokens(20)))
    set_last_used(store, "a", 1000.0)
    info = store.info("a")
    assert info is not None and info.last_used == 1000.0
    assert store.get("a") is not None
    info = store.info("a")
    assert info is not None and info.last_used > time.time() - 60


@pytest.mark.parametrize("ttl_s", [0, -5])
def test_a_ttl_that_is_not_positive_is_refused(backend_factory: Factory, ttl_s: int) -> None:
    with pytest.raises(ValueError, match="ttl_s must be positive"):
        backend_factory(tiny_spec(), ttl_s=ttl_s)
