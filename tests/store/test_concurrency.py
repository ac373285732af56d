"""Two processes putting the same agent at once: one complete cache survives, never a mix.

Each writer's token ids name the writer, and the synthetic KV is a function of the
tokens, so a cache holding blocks from both writers (or a stale block after its
manifest) cannot pass `make_cache(spec, got.token_ids)` equality.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

import pytest

from store.backend import BlockBackend
from store.disk import DiskStore
from store.manifest import Manifest
from store.redis_store import RedisStore
from tests.store.conftest import assert_same_cache, make_cache, redis_value_keys, tiny_spec

AGENT = "shared-agent"
ROUNDS = 25
CORRUPT = ("checksum", "truncated", "bad_block", "bad_manifest", "agent_mismatch")


def _tokens(writer: int, n: int) -> list[int]:
    return [writer * 100_000 + i for i in range(n)]


def _length(writer: int, round_: int) -> int:
    return 10 + (round_ * 13 + writer * 7) % 70  # 10..79 tokens: partial and full blocks


def _open(kind: str, location: str) -> BlockBackend:
    spec = tiny_spec()
    if kind == "disk":
        return DiskStore(location, spec)
    return RedisStore(location, spec, prefix="conc:")


def _writer(kind: str, location: str, writer: int, go: Any) -> None:
    store = _open(kind, location)
    spec = store.spec
    go.wait(30)
    for round_ in range(ROUNDS):
        store.put(AGENT, make_cache(spec, _tokens(writer, _length(writer, round_))))
    store.close()


def _check_consistent(store: BlockBackend) -> int | None:
    got = store.get(AGENT)
    if got is None:
        return None
    writers = {t // 100_000 for t in got.token_ids}
    assert len(writers) == 1, f"tokens from writers {writers}"
    assert_same_cache(got, make_cache(store.spec, got.token_ids))
    return writers.pop()


def _race(kind: str, location: str) -> None:
    ctx = mp.get_context("spawn")
    go = ctx.Event()
    procs = [ctx.Process(target=_writer, args=(kind, location, w, go)) for w in (1, 2)]
    for proc in procs:
        proc.start()
    reader = _open(kind, location)
    time.sleep(1.0)  # let both children import and open the store
    go.set()
    hits = 0
    while any(p.is_alive() for p in procs):
        if _check_consistent(reader) is not None:
            hits += 1
    for proc in procs:
        proc.join(60)
        assert proc.exitcode == 0
    stats = reader.stats()
    assert all(stats[f"miss_{reason}"] == 0 for reason in CORRUPT), stats
    assert hits > 0
    winner = _check_consistent(reader)
    assert winner in (1, 2)
    final = reader.get(AGENT)
    assert final is not None and final.n_tokens == _length(winner, ROUNDS - 1)  # the writer's last put
    reader.close()


def _stored_blocks(store: BlockBackend) -> set[str]:
    """The block values the store keeps for good, as it names them (disk: the agent's block files;
    Redis: its values without a provisional expiry)."""
    if isinstance(store, DiskStore):
        return {p.name for p in store.root.rglob("blocks/*")}
    assert isinstance(store, RedisStore)
    return redis_value_keys(store._client, store.prefix, persistent_only=True)


def _referenced(store: BlockBackend, manifest: Manifest) -> set[str]:
    """The names `_stored_blocks` gives the blocks the manifest references."""
    if isinstance(store, DiskStore):
        return {f"{ref.name}.safetensors" for ref in manifest.blocks}
    assert isinstance(store, RedisStore)
    return set(store.keys.of_refs(AGENT, manifest.blocks, manifest.part_bytes))


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["disk", "redis-server"])
def test_two_processes(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    location = str(tmp_path / "store") if kind == "disk" else request.getfixturevalue("redis_url")
    _open(kind, location).close()  # create the disk store's root before the race
    _race(kind, location)
    store = _open(kind, location)
    manifest = store.read_manifest(AGENT)
    assert manifest is not None
    # Own blocks of aborted attempts are deleted by their writer (Redis: shared ones left on their
    # provisional expiry), and shared blocks no manifest uses collected: nothing else may stay.
    assert _stored_blocks(store) == _referenced(store, manifest)
    store.close()
