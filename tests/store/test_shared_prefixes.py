"""Shared prefixes: full blocks stored once per namespace, refcounted and collected; cross-agent warm starts.

Against a real disk directory (hard links are the reference count) and a real redis-server
(reference sets, checked under WATCH). Blocks are 16 tokens (tiny_spec); the synthetic KV is
a function of (position, token), so agents with the same prefix make byte-identical blocks,
as agents warm-started from one another do with a real model.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from store.backend import BlockBackend
from store.disk import DiskStore
from store.manifest import parse_shared_name
from store.redis_store import RedisStore
from tests.store.conftest import (
    assert_same_cache,
    backends_of_kind,
    make_cache,
    redis_value_keys,
    tiny_spec,
    tokens,
    without_scripting,
)

pytestmark = pytest.mark.integration

PREFIX = tokens(64, seed=42)  # 4 full blocks
Opener = Callable[..., BlockBackend]


@pytest.fixture(params=["disk", "redis-server", "redis-server-without-scripts"])
def opener(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Opener]:
    """Opens backends of one kind over one shared storage (one directory, one Redis); the last kind
    collects shared blocks by its fallback for servers without Lua (WATCH/MULTI after the EXEC)."""
    with backends_of_kind(request.param, request, tmp_path) as open_one:
        yield open_one


def _shared_storage(store: BlockBackend) -> set[str]:
    """Everything the shared area holds: files on disk; values, reference sets and pointers in Redis."""
    if isinstance(store, DiskStore):
        return {str(p.relative_to(store.root)) for p in (store.root / "shared").rglob("*") if p.is_file()}
    assert isinstance(store, RedisStore)
    return {k.decode() for k in store._client.scan_iter(match=f"{store.prefix}s:*")}


def _stored_values(store: BlockBackend) -> int:
    """How many block copies the storage holds (inodes on disk, values in Redis)."""
    if isinstance(store, DiskStore):
        return len({os.stat(p).st_ino for p in store.root.rglob("blocks/*")})
    assert isinstance(store, RedisStore)
    return len(redis_value_keys(store._client, store.prefix))


def test_agents_sharing_a_prefix_store_it_once(opener: Opener) -> None:
    store = opener()
    caches = {f"agent-{i}": make_cache(store.spec, PREFIX + tokens(10, seed=i)) for i in range(5)}
    for agent, cache in caches.items():
        assert store.put(agent, cache)
    block_bytes = store.read_manifest("agent-0").blocks[0].nbytes  # type: ignore[union-attr]
    stats = store.stats()
    assert stats["blocks_linked"] == 4 * 4  # every agent after the first links the 4 prefix blocks
    assert stats["bytes_saved"] == 4 * 4 * block_bytes
    assert stats["blocks_written"] == 4 + 5  # the prefix once, each agent's partial last block
    assert _stored_values(store) == 4 + 5
    for agent, cache in caches.items():
        assert_same_cache(opener().get(agent), cache)


def test_an_agent_without_a_cache_warm_starts_from_another_agents_prefix(opener: Opener) -> None:
    writer = opener()
    writer.put("writer", make_cache(writer.spec, PREFIX + tokens(10, seed=1)))
    reader = opener()  # another worker
    prompt = PREFIX + tokens(30, seed=2)
    got = reader.get("newcomer", prompt_tokens=prompt)
    assert_same_cache(got, make_cache(reader.spec, PREFIX))
    stats = reader.stats()
    assert (stats["cross_agent_hits"], stats["hits"], stats["misses"], stats["miss_absent"]) == (1, 1, 0, 1)
    # A prompt that leaves the prefix inside block 3 resumes from the first two blocks only.
    edited = PREFIX[:40] + tokens(30, seed=3)
    assert_same_cache(reader.get("newcomer", prompt_tokens=edited), make_cache(reader.spec, PREFIX[:32]))
    # Without a prompt there is nothing to match: a plain miss.
    assert reader.get("newcomer") is None


def test_the_longer_of_own_and_shared_wins(opener: Opener) -> None:
    store = opener()
    store.put("writer", make_cache(store.spec, PREFIX + tokens(10, seed=1)))
    store.put("short", make_cache(store.spec, PREFIX[:20]))  # own cache: 20 tokens of the prefix
    prompt = PREFIX + tokens(5, seed=9)
    assert_same_cache(store.get("short", prompt_tokens=prompt), make_cache(store.spec, PREFIX))
    long = make_cache(store.spec, PREFIX + tokens(40, seed=4))
    store.put("long", long)
    hits = store.stats()["cross_agent_hits"]
    assert_same_cache(store.get("long", prompt_tokens=long.token_ids + [1]), long)
    assert store.stats()["cross_agent_hits"] == hits  # its own cache covered more


def test_namespaces_keep_tenants_apart(opener: Opener) -> None:
    tenant_a, tenant_b = opener("tenant-a"), opener("tenant-b")
    tenant_a.put("a1", make_cache(tenant_a.spec, PREFIX + [1]))
    assert tenant_b.get("b1", prompt_tokens=PREFIX + [2]) is None
    assert tenant_b.stats()["cross_agent_hits"] == 0
    tenant_b.put("b1", make_cache(tenant_b.spec, PREFIX + [2]))
    assert tenant_b.stats()["bytes_saved"] == 0  # its own copy, not tenant a's
    assert_same_cache(
        opener("tenant-a").get("a2", prompt_tokens=PREFIX + [3]), make_cache(tenant_a.spec, PREFIX)
    )


def test_shared_blocks_live_while_an_agent_uses_them(opener: Opener) -> None:
    store = opener()
    agents = {f"agent-{i}": make_cache(store.spec, PREFIX + tokens(10, seed=i)) for i in range(3)}
    for agent, cache in agents.items():
        store.put(agent, cache)
    assert store.delete("agent-0") and store.delete("agent-1")
    assert store.stats()["shared_collected"] == 0
    assert_same_cache(store.get("agent-2"), agents["agent-2"])
    # Replacing the last user's cache with other tokens releases the prefix blocks: collected.
    store.put("agent-2", make_cache(store.spec, tokens(40, seed=7)))
    assert store.stats()["shared_collected"] == 4
    assert store.get("probe", prompt_tokens=PREFIX + [1]) is None  # nothing left to warm-start from
    assert store.delete("agent-2")
    assert _shared_storage(store) == set()
    assert _stored_values(store) == 0


def test_a_budget_counts_a_shared_prefix_once(opener: Opener) -> None:
    writer = opener()
    agents = [f"agent-{i}" for i in range(5)]
    for i, agent in enumerate(agents):
        writer.put(agent, make_cache(writer.spec, PREFIX + tokens(10, seed=i)))
        time.sleep(0.01)  # agent-0 is the least recently used
    manifest = writer.read_manifest("agent-0")
    assert manifest is not None
    prefix_bytes = sum(ref.nbytes for ref in manifest.blocks[:4])
    own = {agent: info.nbytes - prefix_bytes for agent in agents if (info := writer.info(agent))}
    held = prefix_bytes + sum(own.values())  # what the storage holds: the prefix once
    assert opener(max_bytes=held).enforce_budget() == 0  # counted per agent, it looked 4 prefixes over

    budgeted = opener(max_bytes=held - 1)
    assert budgeted.enforce_budget() == 1
    assert budgeted.list() == agents[1:]
    assert budgeted.stats()["evicted_bytes"] == own["agent-0"]  # the prefix stays: others use it

    last = opener(max_bytes=prefix_bytes + own["agent-4"])
    assert last.enforce_budget() == 3
    assert last.list() == ["agent-4"]
    assert_same_cache(last.get("agent-4"), make_cache(last.spec, PREFIX + tokens(10, seed=4)))
    alone = opener(max_bytes=own["agent-4"])  # even the prefix's last user goes now (nothing to keep)
    assert alone.enforce_budget() == 1
    assert alone.stats()["evicted_bytes"] == own["agent-4"] + prefix_bytes
    assert _stored_values(alone) == 0


def test_a_damaged_shared_block_is_a_miss_for_its_users(opener: Opener) -> None:
    store = opener()
    for agent in ("a", "b"):
        store.put(agent, make_cache(store.spec, PREFIX + [ord(agent)]))
    manifest = store.read_manifest("a")
    assert manifest is not None
    shared = manifest.blocks[1]
    if isinstance(store, DiskStore):
        path = store._agent_dir("a") / "blocks" / f"{shared.name}.safetensors"  # the same inode as b's
        data = bytearray(path.read_bytes())
        data[-5] ^= 1
        path.write_bytes(bytes(data))
    else:
        assert isinstance(store, RedisStore)
        key = store.keys.parts("a", shared.name, shared.nbytes, manifest.part_bytes)[0]
        value = bytearray(store._client.get(key))  # type: ignore[arg-type]
        value[-5] ^= 1
        store._client.set(key, bytes(value))
    assert store.get("a") is None and store.get("b") is None
    assert store.stats()["miss_checksum"] == 2
    cache = make_cache(store.spec, PREFIX + [9])
    store.put("c", cache)  # the damaged version left with its last user: written again
    assert_same_cache(store.get("c"), cache)


# --- processes racing: puts, replacements and deletes of agents sharing one prefix -------------------
ROUNDS = 12


def _open(kind: str, location: str) -> BlockBackend:
    if kind == "disk":
        return DiskStore(location, tiny_spec())
    return RedisStore(location, tiny_spec(), prefix="race:")


def _churn(kind: str, location: str, worker: int, go: Any) -> None:
    store = _open(kind, location)
    go.wait(30)
    for round_ in range(ROUNDS):
        agent = f"w{worker}-{round_ % 3}"
        store.put(agent, make_cache(store.spec, PREFIX[: 16 * (1 + round_ % 4)] + tokens(5, seed=round_)))
        if round_ % 4 == 3:
            store.delete(f"w{worker}-{(round_ + 1) % 3}")
    store.close()


def _race(kind: str, location: str) -> tuple[BlockBackend, set[str]]:
    """Three processes churn; then every surviving agent reads back whole. Returns the store and
    the shared blocks the survivors' manifests use."""
    ctx = mp.get_context("spawn")
    go = ctx.Event()
    procs = [ctx.Process(target=_churn, args=(kind, location, w, go)) for w in range(3)]
    for proc in procs:
        proc.start()
    go.set()
    for proc in procs:
        proc.join(120)
        assert proc.exitcode == 0
    store = _open(kind, location)
    survivors = store.list()
    assert survivors
    referenced: set[str] = set()
    for agent in survivors:
        got = store.get(agent)
        assert got is not None, agent
        assert_same_cache(got, make_cache(store.spec, got.token_ids))
        referenced |= _shared_names(store, agent)
    assert store.stats()["misses"] == 0
    return store, referenced


def _shared_names(store: BlockBackend, agent: str) -> set[str]:
    manifest = store.read_manifest(agent)
    assert manifest is not None
    return {ref.name for ref in manifest.blocks if parse_shared_name(ref.name) is not None}


def _stored_shared(store: BlockBackend) -> set[str]:
    """The names of the shared blocks the store keeps for good (disk: the index of shared blocks,
    after a collection; Redis: values without a provisional expiry)."""
    if isinstance(store, DiskStore):
        store.collect_shared_garbage()
        return {f"{p.parent.name}.{p.stem}" for p in (store.root / "shared").rglob("*.safetensors")}
    assert isinstance(store, RedisStore)
    persistent = redis_value_keys(store._client, store.prefix, persistent_only=True)
    return {key.split(":s:")[1] for key in persistent if ":s:" in key}


@pytest.mark.parametrize("kind", ["disk", "redis-server"])
def test_concurrent_writers_keep_every_shared_block_in_use(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    location = str(tmp_path / "store") if kind == "disk" else request.getfixturevalue("redis_url")
    _open(kind, location).close()  # create the disk store's root before the race
    store, referenced = _race(kind, location)
    users = {name: {a for a in store.list() if name in _shared_names(store, a)} for name in referenced}
    stored = _stored_shared(store)
    if isinstance(store, DiskStore):
        # Publishing to the index is best effort (a writer that lost the race keeps its own copy).
        assert stored <= referenced  # nothing unused survives
        for name in stored:  # the index's copy is linked by at least one agent, by no more than use it
            assert 1 <= store._shared_users(name) <= len(users[name])
    else:
        assert isinstance(store, RedisStore)
        assert stored == referenced  # no leak, none gone
        for name in referenced:
            assert store._shared_users(name) == len(users[name])
            members = store._client.smembers(store.keys.refs(name))
            assert {m.decode() if isinstance(m, bytes) else m for m in members} == users[name]


class _Killed(Exception):
    """Stands for a SIGKILL right after the transaction that swapped the manifest."""


def test_a_writer_dying_right_after_its_exec_leaves_no_unused_shared_block(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The release of replaced shared blocks runs inside the MULTI that swaps the manifest."""
    store = RedisStore(redis_url, tiny_spec())
    store.put("a", make_cache(store.spec, PREFIX + [1]))

    def killed(_released: object) -> None:
        raise _Killed

    monkeypatch.setattr(store, "_collect_shared", killed)
    with pytest.raises(_Killed):
        store.put("a", make_cache(store.spec, tokens(40, seed=5)))  # replaces all 4 prefix blocks
    client = redis.Redis.from_url(redis_url)
    manifest = store.read_manifest("a")
    assert manifest is not None
    referenced = set(store.keys.of_refs("a", manifest.blocks, manifest.part_bytes))
    assert redis_value_keys(client, store.prefix, persistent_only=True) == referenced
    assert store.stats()["shared_collected"] == 4


def test_collect_shared_garbage_finds_what_no_agent_uses(opener: Opener) -> None:
    store = opener()
    store.put("a", make_cache(store.spec, PREFIX + [1]))
    if isinstance(store, DiskStore):
        # A writer that published a block and died before its manifest: only the index links it.
        path = next((store.root / "shared").rglob("*.safetensors"))
        path.with_name("0badc0de.safetensors").write_bytes(path.read_bytes())
    else:
        assert isinstance(store, RedisStore)
        # A reference set lost with a damaged manifest: the block is committed but nobody uses it.
        manifest = store.read_manifest("a")
        assert manifest is not None
        store._client.delete(store.keys.refs(manifest.blocks[0].name))
    assert store.collect_shared_garbage() == 1
    assert store.collect_shared_garbage() == 0
    if isinstance(store, RedisStore):
        assert store.get("a") is None  # the block it lost track of is gone: a counted miss
        assert store.stats()["miss_missing_block"] == 1
    else:
        assert_same_cache(store.get("a"), make_cache(store.spec, PREFIX + [1]))


# --- servers without scripting: collection by WATCH/MULTI after the manifest's EXEC ------------------
def test_without_scripting_a_released_block_is_collected_with_its_pointer(redis_url: str) -> None:
    store = without_scripting(RedisStore(redis_url, tiny_spec()))
    store.put("a", make_cache(store.spec, PREFIX + [1]))
    assert store.put("a", make_cache(store.spec, tokens(40, seed=5)))  # releases the 4 prefix blocks
    assert store.shared_blocks.scripting is False  # the fallback, not the script, collected them
    assert store.stats()["shared_collected"] == 4
    manifest = store.read_manifest("a")
    assert manifest is not None
    in_use = {ref.name.partition(".")[0] for ref in manifest.blocks if parse_shared_name(ref.name)}
    left = {key.decode() for key in store._client.scan_iter(match=f"{store.prefix}s:*")}
    assert {key.split(":s:")[1].partition(".")[0].partition(":")[0] for key in left} == in_use
    assert store.get("probe", prompt_tokens=PREFIX + [1]) is None  # no pointer leads to the prefix
    store.close()


def test_without_scripting_a_pointer_naming_another_version_is_kept(redis_url: str) -> None:
    store = without_scripting(RedisStore(redis_url, tiny_spec()))
    store.put("a", make_cache(store.spec, PREFIX + [1]))
    manifest = store.read_manifest("a")
    assert manifest is not None
    first = manifest.blocks[0]
    pointer = store.keys.pointer(first.name.partition(".")[0])
    store._client.set(pointer, "0badc0de:123")  # since replaced by another version of the same tokens
    store.put("a", make_cache(store.spec, tokens(40, seed=5)))
    assert store.stats()["shared_collected"] == 4
    assert store._client.get(pointer) == b"0badc0de:123"
    store.close()


def test_without_scripting_an_agent_adopting_the_block_during_its_collection_keeps_it(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between the collector's check (no references) and its EXEC, another agent commits a manifest
    that uses the block: the WATCHed reference set aborts the deletion, and that agent reads whole."""
    store = without_scripting(RedisStore(redis_url, tiny_spec()))
    other = without_scripting(RedisStore(redis_url, tiny_spec()))
    store.put("a", make_cache(store.spec, PREFIX + [1]))
    adopter = make_cache(other.spec, PREFIX + [2])
    pipeline = store._client.pipeline

    def pipeline_with_an_adoption(*args: Any, **kwargs: Any) -> Any:
        pipe = pipeline(*args, **kwargs)
        scard = pipe.scard

        def check_then_adopt(key: str) -> Any:
            count = scard(key)
            if "b" not in other.list():
                assert other.put("b", adopter)  # links the 4 stored prefix blocks
            return count

        pipe.scard = check_then_adopt  # type: ignore[method-assign,assignment]
        return pipe

    monkeypatch.setattr(store._client, "pipeline", pipeline_with_an_adoption)
    store.put("a", make_cache(store.spec, tokens(40, seed=5)))  # releases the prefix; "b" adopts it
    assert other.stats()["blocks_linked"] == 4
    assert store.stats().get("shared_collected", 0) == 0
    assert_same_cache(other.get("b"), adopter)
    store.close()
    other.close()


def test_a_put_whose_linked_block_was_collected_before_its_swap_is_planned_again(
    opener: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every backend retries the guarded swap while the race budget allows (store/backend.py
    `race_attempts`), disk's lock included: a shared block the plan links, collected between the write
    and the swap, makes the put plan and write again, not fail."""
    store = opener()
    blocks_exist = store._blocks_exist  # type: ignore[attr-defined]
    checks: list[int] = []

    def collected_once(guard: Any, agent_id: str, refs: Any) -> bool:
        checks.append(len(refs))
        return len(checks) > 1 and bool(blocks_exist(guard, agent_id, refs))

    monkeypatch.setattr(store, "_blocks_exist", collected_once)
    cache = make_cache(store.spec, PREFIX + tokens(10, seed=3))
    assert store.put("agent", cache)
    assert checks[0] == 4, "the first check is of the 4 shared blocks the plan links"
    assert store.stats()["put_retries"] == 1
    monkeypatch.undo()
    assert_same_cache(opener().get("agent"), cache)
