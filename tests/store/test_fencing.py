"""Fencing: a put whose fence is below the stored one is dropped, atomically, on every backend.

The worker takes an agent's lock together with a fence from a Redis INCR; a worker that
lost the lock (paused, partitioned) and writes late must not replace the newer cache.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from store.backend import BlockBackend
from store.disk import MANIFEST, DiskStore
from store.manifest import _metadata_checksum, encode_manifest
from store.redis_store import RedisStore
from store.stfile import encode, parse_header, view
from tests.store.conftest import assert_same_cache, make_cache, redis_value_keys, tiny_spec, tokens

Factory = Callable[..., DiskStore | RedisStore]


def test_a_lower_fence_is_dropped_and_an_equal_or_higher_one_written(backend_factory: Factory) -> None:
    spec = tiny_spec()
    store = backend_factory(spec)
    winner = make_cache(spec, tokens(40, seed=1))
    assert store.put("a", winner, fence=5) is True
    assert store.put("a", make_cache(spec, tokens(50, seed=2)), fence=3) is False
    assert store.stats()["stale_puts"] == 1
    assert store.stats()["puts"] == 1
    assert_same_cache(store.get("a"), winner)
    again = make_cache(spec, tokens(30, seed=3))
    assert store.put("a", again, fence=5) is True  # the same holder may put many times
    assert_same_cache(store.get("a"), again)
    assert store.put("a", make_cache(spec, tokens(20, seed=4)), fence=6) is True
    manifest = store.read_manifest("a")
    assert manifest is not None and manifest.fence == 6


def test_an_unfenced_put_keeps_the_stored_fence(backend_factory: Factory) -> None:
    spec = tiny_spec()
    store = backend_factory(spec)
    store.put("a", make_cache(spec, tokens(20)), fence=7)
    unfenced = make_cache(spec, tokens(25, seed=1))
    assert store.put("a", unfenced) is True
    manifest = store.read_manifest("a")
    assert manifest is not None and manifest.fence == 7
    assert store.put("a", make_cache(spec, tokens(30, seed=2)), fence=6) is False
    assert_same_cache(store.get("a"), unfenced)


def test_a_stale_put_leaves_no_blocks_behind(backend_factory: Factory, tmp_path: Path) -> None:
    spec = tiny_spec()
    store = backend_factory(spec)
    store.put("a", make_cache(spec, tokens(40)), fence=2)
    before = store.info("a")
    assert store.put("a", make_cache(spec, tokens(64, seed=9)), fence=1) is False
    assert store.info("a") == before
    if isinstance(store, DiskStore):
        blocks = list((tmp_path / "store").rglob("blocks/*"))
        manifest = store.read_manifest("a")
        assert manifest is not None and len(blocks) == len(manifest.blocks)


@pytest.mark.parametrize("fence", [-1, "3", 2.0, True])
def test_a_bad_fence_is_refused_before_any_io(backend_factory: Factory, fence: Any) -> None:
    store = backend_factory(tiny_spec())
    with pytest.raises((TypeError, ValueError)):
        store.put("a", make_cache(store.spec, tokens(10)), fence=fence)
    assert store.list() == []


def _without_fence(blob: bytes) -> bytes:
    """The manifest as the store wrote it before fencing existed (no `fence` metadata)."""
    metadata, entries, start = parse_header(blob)
    del metadata["fence"]
    metadata["checksum"] = str(_metadata_checksum(metadata))
    tokens_array = view(blob, entries["token_ids"], start)
    header, buffers = encode([("token_ids", "I64", tokens_array)], metadata)
    return b"".join([header, *buffers])


def test_a_manifest_without_a_fence_reads_as_fence_zero(backend_factory: Factory, tmp_path: Path) -> None:
    spec = tiny_spec()
    store = backend_factory(spec)
    cache = make_cache(spec, tokens(40))
    store.put("a", cache)
    manifest = store.read_manifest("a")
    assert manifest is not None
    old = _without_fence(encode_manifest(manifest))
    if isinstance(store, DiskStore):
        (store._agent_dir("a") / MANIFEST).write_bytes(old)
    else:
        store._client.set(store.keys.manifest("a"), old)
    reread = store.read_manifest("a")
    assert reread is not None and reread.fence == 0
    assert_same_cache(store.get("a"), cache)
    assert store.put("a", make_cache(spec, tokens(50, seed=1)), fence=1) is True


def test_a_delete_forgets_the_fence(backend_factory: Factory) -> None:
    """The fence lives in the manifest: once the cache is gone (delete, eviction, TTL) any fence writes."""
    spec = tiny_spec()
    store = backend_factory(spec)
    store.put("a", make_cache(spec, tokens(20)), fence=9)
    store.delete("a")
    assert store.put("a", make_cache(spec, tokens(20)), fence=1) is True


def test_disk_put_over_an_expired_cache_does_not_deadlock(tmp_path: Path) -> None:
    """The put reads the old manifest under the agent's lock; expiry must not take the lock again."""
    import os

    spec = tiny_spec()
    store = DiskStore(tmp_path / "store", spec, ttl_s=60)
    store.put("a", make_cache(spec, tokens(40)), fence=3)
    manifest_path = store._agent_dir("a") / MANIFEST
    os.utime(manifest_path, (1, 1))  # last used in 1970: expired
    assert store.put("a", make_cache(spec, tokens(40, seed=1)), fence=2) is False  # fence still honoured
    newer = make_cache(spec, tokens(40, seed=2))
    assert store.put("a", newer, fence=3) is True
    assert_same_cache(store.get("a"), newer)


# --- two real processes racing, one with a lower fence ----------------------------------------------
AGENT = "fenced-agent"


def _open(kind: str, location: str) -> BlockBackend:
    if kind == "disk":
        return DiskStore(location, tiny_spec())
    return RedisStore(location, tiny_spec(), prefix="fence:")


def _low_writer(kind: str, location: str, go: Any, stop: Any, results: Any) -> None:
    """Puts with fence 1 until told to stop; records each put's outcome in order."""
    store = _open(kind, location)
    go.wait(30)
    n = 0
    while not stop.is_set() or n < 5:
        results.append(store.put(AGENT, make_cache(store.spec, tokens(20 + n % 40, seed=1000 + n)), fence=1))
        n += 1
        if n > 2000:
            break
    store.close()


def _race(kind: str, location: str) -> None:
    ctx = mp.get_context("spawn")
    manager = ctx.Manager()
    go, stop, results = ctx.Event(), ctx.Event(), manager.list()
    low = ctx.Process(target=_low_writer, args=(kind, location, go, stop, results))
    low.start()
    store = _open(kind, location)
    go.set()
    while len(results) < 3:  # the low writer is well under way
        assert low.is_alive()
    high = make_cache(store.spec, tokens(70, seed=7))
    assert store.put(AGENT, high, fence=2) is True
    count_at_high = len(results)
    while len(results) < count_at_high + 5:  # the low writer keeps trying after the takeover
        assert low.is_alive()
    stop.set()
    low.join(60)
    assert low.exitcode == 0
    outcomes = list(results)
    first_false = outcomes.index(False)
    # Once the fence-2 put committed, every later fence-1 put was dropped: never a True again.
    assert all(outcomes[:first_false]) and not any(outcomes[first_false:])
    assert first_false <= count_at_high + 1  # at most the put in flight during the takeover landed first
    assert_same_cache(store.get(AGENT), high)
    manifest = store.read_manifest(AGENT)
    assert manifest is not None and manifest.fence == 2
    manager.shutdown()
    store.close()


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["disk", "redis-server"])
def test_a_lower_fence_loses_to_a_concurrent_writer(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if kind == "disk":
        location = str(tmp_path / "store")
        DiskStore(location, tiny_spec()).close()  # create the root before the race
        _race("disk", location)
    else:
        _race("redis", request.getfixturevalue("redis_url"))


# --- a fence lost on a retry, after this put wrote its blocks ----------------------------------------
def _every_key(store: RedisStore) -> set[str]:
    return {key.decode() for key in store._client.scan_iter(match=f"{store.prefix}*")}


def test_a_fence_lost_on_a_retry_after_writing_blocks_leaks_no_value(
    store_and_rival: tuple[RedisStore, RedisStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Our put (fence 1) writes its new blocks, own and shared; before its EXEC a newer holder (fence 2)
    commits, so the EXEC aborts; the retry finds the higher fence and drops the put. Every value it wrote
    must go: what Redis holds afterwards is exactly what it held right after the newer holder's commit,
    less the values this put wrote."""
    store, rival = store_and_rival
    base = tokens(40, seed=1)
    assert rival.put(AGENT, make_cache(rival.spec, base), fence=1)
    before_put = _every_key(store)
    ours: set[str] = set()
    ours_values: set[str] = set()
    after_rival: set[str] = set()
    swaps: list[object] = []
    original = store._swap_manifest

    def rival_commits_first(tx: object, agent_id: str, *args: Any) -> object:
        nonlocal ours, after_rival
        if not ours:
            ours = _every_key(store) - before_put  # what our put wrote before its EXEC
            ours_values.update(ours & redis_value_keys(store._client, store.prefix))
            newer = make_cache(rival.spec, base + tokens(10, seed=2))  # keeps the blocks our put kept too
            assert rival.put(AGENT, newer, fence=2)
            after_rival = _every_key(store)
        swaps.append(original(tx, agent_id, *args))
        return swaps[-1]

    monkeypatch.setattr(store, "_swap_manifest", rival_commits_first)
    # The 2 full blocks of the stored 40 tokens kept; 4 full (shared) blocks and a partial (own) one written.
    assert store.put(AGENT, make_cache(store.spec, base + tokens(60, seed=3)), fence=1) is False
    # The put went on to its EXEC, which aborted (None), and lost the fence on its retry, before a swap.
    assert swaps == [None]
    assert store.stats()["stale_puts"] == 1 and store.stats()["put_retries"] == 1
    assert len(ours) == 5 and ours_values == ours  # the path under test: blocks written, then the fence lost
    assert any(":b:" in key for key in ours) and any(f"{store.prefix}s:" in key for key in ours)
    leaked = _every_key(store) - (after_rival - ours)
    assert leaked == set(), f"{len(leaked)} keys leaked: {sorted(leaked)}"
    assert _every_key(store) == after_rival - ours  # and nothing of the newer holder's went with them
    manifest = rival.read_manifest(AGENT)
    assert manifest is not None and manifest.fence == 2
