"""DiskStore specifics: files the safetensors library reads, atomicity, crash leftovers, TTL."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

from store import disk as disk_module
from store.disk import MANIFEST, DiskStore
from store.errors import StoreError
from tests.store.conftest import assert_same_cache, make_cache, tiny_spec, tokens


def test_files_open_with_the_safetensors_library(tmp_path: Path) -> None:
    spec = tiny_spec()
    store = DiskStore(tmp_path / "s", spec)
    cache = make_cache(spec, tokens(40))
    store.put("a", cache)
    manifest = store.read_manifest("a")
    assert manifest is not None
    directory = store._agent_dir("a")
    loaded = load_file(directory / MANIFEST)
    assert loaded["token_ids"].tolist() == cache.token_ids
    with safe_open(str(directory / MANIFEST), framework="numpy") as handle:
        meta = handle.metadata()
    assert meta["fingerprint"] == spec.fingerprint() and meta["quantization"] == "none"
    assert meta["version"] == "5" and meta["agent_id"] == "a" and meta["part_bytes"] == "0"
    for ref, block in zip(manifest.blocks, cache.blocks, strict=True):
        tensors = load_file(directory / "blocks" / f"{ref.name}.safetensors")
        assert set(tensors) == {f"L{i}.{kind}" for i in range(spec.n_layers) for kind in "kv"}
        for layer in range(spec.n_layers):
            assert np.array_equal(tensors[f"L{layer}.k"], block.keys[layer])
            assert np.array_equal(tensors[f"L{layer}.v"], block.values[layer])


def test_a_crash_before_the_manifest_leaves_the_previous_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = tiny_spec()
    store = DiskStore(tmp_path / "s", spec)
    old = make_cache(spec, tokens(40))
    store.put("a", old)

    def crash(path: Path, parts: object, *, fsync: bool) -> None:
        raise OSError("power cut")

    monkeypatch.setattr(disk_module, "write_atomic", crash)  # the manifest's write
    with pytest.raises(OSError):
        store.put("a", make_cache(spec, tokens(90, seed=1)))  # new blocks are on disk, no manifest
    monkeypatch.undo()
    assert_same_cache(store.get("a"), old)
    blocks_dir = store._agent_dir("a") / "blocks"
    assert len(list(blocks_dir.iterdir())) > 3  # the crashed put's orphans
    new = make_cache(spec, tokens(50, seed=2))
    store.put("a", new)
    assert len(list(blocks_dir.iterdir())) == 4  # orphans collected by the next put
    assert_same_cache(store.get("a"), new)


def test_leftover_temp_files_are_collected(tmp_path: Path) -> None:
    spec = tiny_spec()
    store = DiskStore(tmp_path / "s", spec)
    store.put("a", make_cache(spec, tokens(20)))
    directory = store._agent_dir("a")
    (directory / ".tmp-dead").write_bytes(b"half a manifest")
    (directory / "blocks" / ".tmp-dead").write_bytes(b"half a block")
    store.put("a", make_cache(spec, tokens(30)))
    assert not list(directory.rglob(".tmp-*"))


def test_no_temp_files_after_normal_puts(tmp_path: Path) -> None:
    spec = tiny_spec()
    store = DiskStore(tmp_path / "s", spec)
    for n in (10, 40, 70):
        store.put("a", make_cache(spec, tokens(n)))
    assert not list((tmp_path / "s").rglob(".tmp-*"))


def test_refuses_a_foreign_non_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(StoreError):
        DiskStore(tmp_path, tiny_spec())
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "kvrq-store.json").write_text('{"format": "kvrq-store", "layout": 99}')
    with pytest.raises(StoreError):
        DiskStore(tmp_path / "other", tiny_spec())


def test_ttl_expires_unused_agents(tmp_path: Path) -> None:
    spec = tiny_spec()
    store = DiskStore(tmp_path / "s", spec, ttl_s=60)
    store.put("old", make_cache(spec, tokens(20)))
    store.put("new", make_cache(spec, tokens(20, seed=1)))
    manifest = store._agent_dir("old") / MANIFEST
    past = time.time() - 120
    os.utime(manifest, (past, past))
    assert store.get("old") is None
    assert store.stats()["expired"] == 1
    assert store.get("new") is not None
    assert store.list() == ["new"]
    assert not store._agent_dir("old").exists()


def test_fsync_can_be_turned_off(tmp_path: Path) -> None:
    spec = tiny_spec()
    store = DiskStore(tmp_path / "s", spec, fsync=False)
    cache = make_cache(spec, tokens(40))
    store.put("a", cache)
    assert_same_cache(store.get("a"), cache)
