"""Anonymous prefixes: get_prefix / put_prefix, their LRU budget, and namespaces kept apart.

Against a real disk directory and a real redis-server (with and without Lua: the eviction's two
paths), and fakeredis for the quick cases. Blocks are 16 tokens (tiny_spec); the synthetic KV is a
function of (position, token), so equal prefixes make byte-identical blocks, as with a real model.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import store.block_codec
import store.prefix_holds
from engine.core.blocks import AgentCache
from store.backend import BlockBackend
from store.disk import DiskStore
from store.hot import HotTierStore
from store.redis_shared import PREFIX_HOLDER
from store.redis_store import RedisStore
from tests.store.conftest import (
    assert_same_cache,
    backends_of_kind,
    make_cache,
    redis_value_keys,
    tiny_spec,
    tokens,
)

PREFIX = tokens(64, seed=42)  # 4 full blocks
Opener = Callable[..., BlockBackend]
KINDS = [
    "disk",
    "fakeredis",
    pytest.param("redis-server", marks=pytest.mark.integration),
    pytest.param("redis-server-without-scripts", marks=pytest.mark.integration),
]


@pytest.fixture(params=KINDS)
def opener(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Opener]:
    """Several backends over one storage stand for several workers."""
    with backends_of_kind(request.param, request, tmp_path) as open_one:
        yield open_one


def _cache(backend: BlockBackend, token_ids: list[int]) -> AgentCache:
    return make_cache(backend.spec, token_ids)


def _block_bytes(backend: BlockBackend) -> int:
    """The stored size of one full block (all full blocks of tiny_spec have the same)."""
    probe = _cache(backend, tokens(16, seed=999))
    return store.block_codec.encode_block(probe.blocks[0], backend.spec, "none", 0).nbytes


def _stored_copies(backend: BlockBackend) -> int:
    """How many block copies the storage holds (inodes on disk, values in Redis)."""
    if isinstance(backend, DiskStore):
        files = [p for p in backend.root.rglob("*.safetensors") if p.parent.name != "locks"]
        return len({os.stat(p).st_ino for p in files})
    assert isinstance(backend, RedisStore)
    return len(redis_value_keys(backend._client, backend.prefix))


def test_round_trip_and_a_stored_block_costs_a_lookup(
    opener: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer, reader = opener(), opener()
    assert writer.put_prefix(_cache(writer, PREFIX + tokens(10, seed=1)))
    assert writer.stats()["prefix_blocks_written"] == 4  # the partial last block is not offered
    got = reader.get_prefix(PREFIX + tokens(30, seed=2))
    assert_same_cache(got, _cache(reader, PREFIX))
    stats = reader.stats()
    assert (stats["prefix_gets"], stats["prefix_hits"], stats["prefix_tokens"]) == (1, 1, 64)
    # Another job's put of the same prefix encodes and writes nothing: it finds and holds the blocks.
    copies = _stored_copies(writer)

    def no_encoding(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("a stored block was encoded again")

    monkeypatch.setattr(store.prefix_holds, "encode_block", no_encoding)  # put_prefix's encoder
    assert reader.put_prefix(_cache(reader, PREFIX + tokens(3, seed=3)))
    assert (reader.stats()["prefix_blocks_held"], reader.stats()["prefix_blocks_written"]) == (4, 0)
    assert _stored_copies(writer) == copies


def test_a_block_collected_between_the_lookup_and_the_hold_is_written_again(
    opener: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The put's loop (store/prefix_holds.py `_store_prefix`, one for every backend): a stored version
    found by the lookup but evicted before the hold is reported missing, encoded and written again."""
    writer, other = opener(), opener()
    assert other.put_prefix(_cache(other, PREFIX))
    find_versions = writer._find_versions  # type: ignore[attr-defined]

    def found_then_collected(shares: list[str]) -> list[object]:
        versions = list(find_versions(shares))
        for entry in other._prefix_entries():  # type: ignore[attr-defined]
            assert other._evict_prefix(entry)  # type: ignore[attr-defined]
        return versions

    monkeypatch.setattr(writer, "_find_versions", found_then_collected)
    assert writer.put_prefix(_cache(writer, PREFIX + tokens(5, seed=4)))
    stats = writer.stats()
    assert (stats["prefix_blocks_held"], stats["prefix_blocks_written"]) == (0, 4)
    assert_same_cache(other.get_prefix(PREFIX + tokens(20, seed=9)), _cache(other, PREFIX))


def test_the_longest_run_of_full_blocks_is_found(opener: Opener) -> None:
    backend = opener()
    tail = tokens(32, seed=5)
    backend.put_prefix(_cache(backend, PREFIX + tail))  # 6 full blocks
    assert_same_cache(
        backend.get_prefix(PREFIX + tail[:20] + tokens(9, seed=6)), _cache(backend, PREFIX + tail[:16])
    )
    assert_same_cache(backend.get_prefix(PREFIX[:40] + tokens(30, seed=7)), _cache(backend, PREFIX[:32]))
    assert backend.get_prefix(PREFIX[:15]) is None  # not one full block
    assert backend.get_prefix(tokens(64, seed=8)) is None
    stats = backend.stats()
    assert (stats["prefix_hits"], stats["prefix_misses"]) == (2, 2)


def test_agents_and_anonymous_jobs_reuse_each_others_blocks(opener: Opener) -> None:
    backend = opener()
    backend.put("agent", _cache(backend, PREFIX[:32] + [7]))
    assert_same_cache(backend.get_prefix(PREFIX + [1]), _cache(backend, PREFIX[:32]))
    backend.put_prefix(_cache(backend, PREFIX))
    assert_same_cache(backend.get("newcomer", prompt_tokens=PREFIX + [2]), _cache(backend, PREFIX))
    assert backend.stats()["cross_agent_hits"] == 1


def test_namespaces_never_share_prefixes(opener: Opener) -> None:
    tenant_a, tenant_b = opener(namespace="tenant-a"), opener(namespace="tenant-b")
    tenant_a.put_prefix(_cache(tenant_a, PREFIX))
    tenant_a.put("a1", _cache(tenant_a, PREFIX + [1]))
    assert tenant_b.get_prefix(PREFIX + [2]) is None
    assert tenant_b.get("b1", prompt_tokens=PREFIX + [2]) is None
    assert tenant_b.stats()["prefix_tokens"] == 0 and tenant_b.stats()["cross_agent_hits"] == 0
    # Per call: one store serving both tenants keeps them apart the same way.
    shared = opener()
    assert shared.get_prefix(PREFIX + [3], namespace="tenant-b") is None
    assert_same_cache(shared.get_prefix(PREFIX + [3], namespace="tenant-a"), _cache(shared, PREFIX))
    assert shared.get("a1", namespace="tenant-b") is None  # an agent stored by tenant a
    assert shared.stats()["miss_namespace_mismatch"] == 1
    assert_same_cache(shared.get("a1", namespace="tenant-a"), _cache(shared, PREFIX + [1]))
    shared.put_prefix(_cache(shared, PREFIX), namespace="tenant-b")
    assert shared.stats()["prefix_blocks_written"] == 4  # its own copy, not tenant a's
    assert_same_cache(tenant_b.get_prefix(PREFIX + [4]), _cache(tenant_b, PREFIX))


def test_eviction_takes_unreferenced_blocks_least_recently_used_first(opener: Opener) -> None:
    block = _block_bytes(opener())
    backend = opener(prefix_max_bytes=4 * block)
    first, second, third = (tokens(32, seed=s) for s in (11, 12, 13))
    backend.put_prefix(_cache(backend, first))
    backend.put_prefix(_cache(backend, second))  # 4 blocks: at the budget
    assert backend.stats()["prefix_evictions"] == 0
    assert backend.get_prefix(first)  # a hit makes `first` the most recent
    backend.put_prefix(_cache(backend, third))
    assert backend.stats()["prefix_evictions"] == 2
    assert backend.get_prefix(second) is None  # the least recently used went, whole
    assert_same_cache(backend.get_prefix(first), _cache(backend, first))
    assert_same_cache(backend.get_prefix(third), _cache(backend, third))
    # Past the budget by one block: a run loses its last block first, never its first.
    backend.put_prefix(_cache(backend, tokens(16, seed=14)))
    assert_same_cache(backend.get_prefix(first), _cache(backend, first[:16]))


def test_blocks_an_agent_links_are_never_evicted_by_the_prefix_budget(opener: Opener) -> None:
    block = _block_bytes(opener())
    backend = opener(prefix_max_bytes=2 * block)
    linked = tokens(32, seed=21)
    backend.put_prefix(_cache(backend, linked))  # the oldest prefix...
    backend.put("agent", _cache(backend, linked + [5]))  # ...that an agent uses too
    for seed in (22, 23, 24):
        backend.put_prefix(_cache(backend, tokens(32, seed=seed)))
    assert len(backend._find_shared(_shares(backend, linked))) == 2  # looked up without a touch
    assert backend.stats()["prefix_evictions"] == 4  # 22 and 23, while 24 fills the budget
    # Once no agent links them they are the least recently used unreferenced blocks: first to go.
    backend.delete("agent")
    backend.put_prefix(_cache(backend, tokens(16, seed=25)))
    assert backend.get_prefix(linked) is None
    assert backend.get_prefix(tokens(32, seed=24)) is not None


def test_a_budget_of_zero_turns_anonymous_prefixes_off(opener: Opener) -> None:
    backend = opener(prefix_max_bytes=0)
    assert not backend.put_prefix(_cache(backend, PREFIX))
    backend.put("agent", _cache(backend, PREFIX))
    assert backend.get_prefix(PREFIX) is None
    assert backend.stats()["prefix_misses"] == 1


def _corrupt_shared_block(backend: BlockBackend, name: str, nbytes: int) -> None:
    if isinstance(backend, DiskStore):
        path = backend.shared.path(name)
        assert path is not None
        with open(path, "r+b") as f:  # in place: every link to the block sees it
            f.seek(nbytes - 5)
            byte = f.read(1)
            f.seek(nbytes - 5)
            f.write(bytes([byte[0] ^ 1]))
        return
    assert isinstance(backend, RedisStore)
    key = backend.keys.parts("", name, nbytes, backend.part_bytes)[0]
    value = bytearray(backend._client.get(key))  # type: ignore[arg-type]
    value[-5] ^= 1
    backend._client.set(key, bytes(value))


def test_a_corrupt_prefix_block_is_a_counted_miss_and_is_written_again(opener: Opener) -> None:
    backend = opener()
    backend.put_prefix(_cache(backend, PREFIX))
    names = [name for name, _, _ in backend._find_shared(_shares(backend, PREFIX))]
    assert len(names) == 4
    _corrupt_shared_block(backend, names[2], _block_bytes(backend))
    assert_same_cache(backend.get_prefix(PREFIX + [1]), _cache(backend, PREFIX[:32]))  # up to it
    assert backend.stats()["prefix_damaged"] == 1
    backend.put_prefix(_cache(backend, PREFIX))  # the damaged block was dropped: written again
    assert_same_cache(backend.get_prefix(PREFIX + [1]), _cache(backend, PREFIX))
    _corrupt_shared_block(backend, names[0], _block_bytes(backend))
    assert backend.get_prefix(PREFIX) is None
    stats = backend.stats()
    assert (stats["prefix_damaged"], stats["prefix_misses"]) == (2, 1)


def _shares(backend: BlockBackend, token_ids: list[int]) -> list[str]:
    from store.manifest import chain_keys, share_keys

    n_full = len(token_ids) // backend.spec.block_tokens
    chains = chain_keys(backend.spec, "none", 0, token_ids[: n_full * backend.spec.block_tokens])
    return share_keys(chains, backend.namespace, backend.part_bytes)


def test_the_hot_tier_passes_prefixes_through_behind(opener: Opener) -> None:
    hot = HotTierStore(opener(), 1 << 24)
    try:
        written = hot.put_prefix(_cache(hot.backend, PREFIX + [1]))
        assert written.result(timeout=30) is True
        got = hot.prefetch_prefix(PREFIX + [2]).result(timeout=30)
        assert_same_cache(got, _cache(hot.backend, PREFIX))
        assert hot.prefetch_prefix(PREFIX + [2], namespace="elsewhere").result(timeout=30) is None
        hot.put("agent", _cache(hot.backend, PREFIX + [3]), namespace="team").result(timeout=30)
        assert hot.get("agent", namespace="other") is None  # in memory, but another namespace's
        assert hot.get("agent", namespace="team") is not None
        stats = hot.stats()
        assert (stats["prefix_puts"], stats["prefix_hits"], stats["prefix_misses"]) == (1, 1, 1)
    finally:
        hot.close()


# --- two processes putting the same prefixes at once ---------------------------------------------
ROUNDS = 6


def _put_prefixes(kind: str, location: str, go: Any) -> None:
    backend: BlockBackend
    if kind == "disk":
        backend = DiskStore(location, tiny_spec())
    else:
        backend = RedisStore(location, tiny_spec(), prefix="race:")
    go.wait(30)
    for round_ in range(ROUNDS):
        backend.put_prefix(
            make_cache(backend.spec, PREFIX[: 16 * (1 + round_ % 4)] + tokens(20, seed=round_))
        )
    backend.close()


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["disk", "redis-server"])
def test_concurrent_put_prefix_from_two_processes_keeps_one_copy(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    location = str(tmp_path / "store") if kind == "disk" else request.getfixturevalue("redis_url")
    ctx = mp.get_context("spawn")
    go = ctx.Event()
    procs = [ctx.Process(target=_put_prefixes, args=(kind, location, go)) for _ in range(2)]
    for proc in procs:
        proc.start()
    go.set()
    for proc in procs:
        proc.join(120)
        assert proc.exitcode == 0
    backend: BlockBackend = (
        DiskStore(location, tiny_spec())
        if kind == "disk"
        else RedisStore(location, tiny_spec(), prefix="race:")
    )
    try:
        for round_ in range(ROUNDS):
            full = PREFIX[: 16 * (1 + round_ % 4)] + tokens(20, seed=round_)
            expected = full[: len(full) // 16 * 16]
            assert_same_cache(backend.get_prefix(full), make_cache(backend.spec, expected))
        # One copy per distinct block: the 4 prefix blocks and each round's own full tail blocks.
        distinct = {
            share
            for round_ in range(ROUNDS)
            for share in _shares(backend, PREFIX[: 16 * (1 + round_ % 4)] + tokens(20, seed=round_))
        }
        assert _stored_copies(backend) == len(distinct)
        assert {entry.agents for entry in backend._prefix_entries()} == {0}
        if isinstance(backend, RedisStore):
            for entry in backend._prefix_entries():
                assert backend._client.smembers(backend.keys.refs(entry.name)) == {PREFIX_HOLDER.encode()}
            assert redis_value_keys(backend._client, "race:", persistent_only=True) == redis_value_keys(
                backend._client, "race:"
            )  # every value adopted: none left on its provisional expiry
    finally:
        backend.close()
