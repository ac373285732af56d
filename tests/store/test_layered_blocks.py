"""The store with models whose layers are not all plain full attention (store/layered_codec.py):
real caches from tiny random models, through every backend.

A sliding window moves on and SSM checkpoints age out, so the same tokens' block holds less at
a later put: the block's layout is part of its reuse key and such a block is written again, and
what the store holds is only what the window and the last checkpoints need."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest

from engine.batch.engine import BlockPoolBatchEngine
from engine.core.blocks import AgentCache
from engine.core.params import SamplingParams
from engine.kv.layered import KEEP_CHECKPOINTS
from store.backend import BlockBackend
from tests.engine.test_families import prompt_of, run_all
from tests.engine.tiny import ByteTokenizer, tiny_model

Factory = Callable[..., BlockBackend]


@functools.cache  # one engine run per model for every backend of the matrix (the caches are only read)
def two_turns(arch: str, first_prompt: int, more: int) -> tuple[BlockPoolBatchEngine, AgentCache, AgentCache]:
    engine = BlockPoolBatchEngine(
        tiny_model(arch), ByteTokenizer(), model_name=f"tiny-{arch}", pool_blocks=32, max_context=4096
    )
    params = SamplingParams(max_tokens=8, stop_tokens=())
    uid = engine.submit("a", prompt_of(first_prompt), params)
    first = run_all(engine)[uid].cache
    assert first is not None
    uid = engine.submit("a", list(first.token_ids) + prompt_of(more, salt=5), params, cache=first)
    second = run_all(engine)[uid].cache
    assert second is not None
    engine.close()
    return engine, first, second


def held_tokens(cache: AgentCache, layer: int) -> int:
    return sum(int(block.keys[layer].shape[1]) for block in cache.blocks)


def test_a_block_the_window_left_is_written_again_without_it(backend_factory: Factory) -> None:
    engine, first, second = two_turns("gemma3_text", 761, 300)  # window 32; the ragged batch keeps 761 + 7
    assert first.n_tokens == 768  # the window [736, 768) lies in full block 2
    assert first.blocks[2].layout() != ""
    store = backend_factory(engine.spec)
    store.put("a", first)
    store.put("a", second)
    assert store.stats()["blocks_reused"] == 2  # blocks 0 and 1: same tokens, never held any window
    stored = store.get("a")
    assert stored is not None and stored.n_tokens == second.n_tokens
    for layer in engine.spec.kv_layers():
        expected = 32 if layer.kind == "sliding" else second.n_tokens
        assert held_tokens(stored, layer.index) == expected


def test_only_the_last_checkpoints_stay_in_the_store(backend_factory: Factory) -> None:
    engine, first, second = two_turns("mamba", 900, 400)
    store = backend_factory(engine.spec)
    store.put("a", first)
    store.put("a", second)
    stored = store.get("a")
    assert stored is not None
    ends = [(i + 1) * 256 for i, block in enumerate(stored.blocks) if block.states]
    assert ends == [1024, 1280][-KEEP_CHECKPOINTS:]
    info = store.info("a")
    assert info is not None
    assert info.nbytes < (KEEP_CHECKPOINTS + 1) * engine.spec.state_bytes()  # the aged-out one is gone


@pytest.mark.parametrize("arch", ["gemma3_text", "falcon_h1", "openelm", "mamba2"])
def test_layered_caches_round_trip_bit_exact(backend_factory: Factory, arch: str) -> None:
    engine, first, _second = two_turns(arch, 600, 10)
    store = backend_factory(engine.spec)
    store.put("a", first)
    stored = backend_factory(engine.spec).get("a")  # another instance over the same storage
    assert stored is not None
    stored.validate(engine.spec)
    assert stored.token_ids == first.token_ids
    for got, put in zip(stored.blocks, first.blocks, strict=True):
        assert got.layout() == put.layout()
        for x, y in zip(got.keys + got.values, put.keys + put.values, strict=True):
            assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
        for xs, ys in zip(got.states, put.states, strict=True):
            assert [x.tobytes() for x in xs] == [y.tobytes() for y in ys]


def test_a_version_2_cache_of_a_plain_model_still_reads(backend_factory: Factory) -> None:
    """Plain full-attention specs, fingerprints and blocks did not change in version 3 (per-layer specs)."""
    from store.manifest import FORMAT_VERSION_NUMBER, _metadata_checksum
    from store.stfile import encode, parse_header, view
    from tests.store.conftest import assert_same_cache, make_cache, tiny_spec, tokens
    from tests.store.test_corruption import Raw

    spec = tiny_spec()
    store = backend_factory(spec)
    cache = make_cache(spec, tokens(40))
    store.put("a", cache)
    raw = Raw(store, "a")  # type: ignore[arg-type]
    blob = raw.read(raw.manifest_location())
    metadata, entries, start = parse_header(blob)
    assert metadata["version"] == str(FORMAT_VERSION_NUMBER)
    metadata["version"] = "2"
    metadata["checksum"] = str(_metadata_checksum(metadata))
    header, buffers = encode([("token_ids", "I64", view(blob, entries["token_ids"], start))], metadata)
    raw.write(raw.manifest_location(), b"".join([header, *buffers]))
    assert_same_cache(backend_factory(spec).get("a"), cache)
