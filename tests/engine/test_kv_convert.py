"""Gather (blocks -> MLX caches) and extract (caches -> blocks): exact round trips, recycled memory."""

from __future__ import annotations

import gc
import os
import sys
import threading

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from engine.core.blocks import AgentCache
from engine.core.spec import LayerSpec, ModelCacheSpec
from engine.kv import buffers as kv_buffers
from engine.kv import convert as kv_convert
from engine.kv.arena import KVArena
from engine.kv.convert import blocks_to_caches, caches_to_blocks
from engine.kv.fast_copy import PAGE, aliases, copy_array, page_offset_array
from engine.kv.host_slab import BlockSlab


def make_spec(dtype: str = "float32", n_layers: int = 3) -> ModelCacheSpec:
    return ModelCacheSpec("t", n_layers, (LayerSpec("full"),) * n_layers, 2, 16, 8, dtype, block_tokens=32)


def random_layers(spec: ModelCacheSpec, n_tokens: int, seed: int = 0) -> list[KVCache]:
    mx.random.seed(seed)
    dtype = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}[spec.dtype]
    layers = []
    for _ in range(spec.n_layers):
        layer = KVCache()
        keys = mx.random.normal((1, spec.n_kv_heads, n_tokens, spec.k_head_dim)).astype(dtype)
        values = mx.random.normal((1, spec.n_kv_heads, n_tokens, spec.v_head_dim)).astype(dtype)
        layer.state = (keys, values, n_tokens)
        layers.append(layer)
    mx.eval([layer.state[:2] for layer in layers])
    return layers


def assert_same_kv(a: list[KVCache], b: list[KVCache], n_tokens: int) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.offset >= n_tokens and y.offset >= n_tokens
        for u, v in ((x.keys, y.keys), (x.values, y.values)):
            assert u is not None and v is not None
            assert mx.array_equal(u[..., :n_tokens, :], v[..., :n_tokens, :]).item()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("n_tokens", [1, 31, 32, 33, 100])
def test_extract_then_gather_is_exact(dtype: str, n_tokens: int) -> None:
    spec = make_spec(dtype)
    layers = random_layers(spec, n_tokens)
    cache = caches_to_blocks(layers, list(range(n_tokens)), spec, BlockSlab(spec.bytes_per_block(), 8))
    cache.validate(spec)
    assert [b.n_tokens for b in cache.blocks][-1] == n_tokens - 32 * (len(cache.blocks) - 1)
    rebuilt = blocks_to_caches(cache, n_tokens)
    assert_same_kv(layers, rebuilt, n_tokens)
    assert all(layer.offset == n_tokens for layer in rebuilt)


def test_gather_allocates_the_asked_capacity_in_whole_blocks() -> None:
    spec = make_spec()
    cache = caches_to_blocks(random_layers(spec, 40), list(range(40)), spec)
    rebuilt = blocks_to_caches(cache, 35, capacity=70)
    assert rebuilt[0].keys is not None and rebuilt[0].keys.shape[2] == 96
    assert rebuilt[0].offset == 35


def test_gathered_cache_keeps_working_as_a_kv_cache() -> None:
    spec = make_spec()
    layers = random_layers(spec, 40)
    rebuilt = blocks_to_caches(caches_to_blocks(layers, list(range(40)), spec), 40, capacity=64)
    new_k = mx.ones((1, spec.n_kv_heads, 3, spec.k_head_dim))
    new_v = mx.ones((1, spec.n_kv_heads, 3, spec.v_head_dim))
    keys, _ = rebuilt[0].update_and_fetch(new_k, new_v)
    assert keys.shape[2] == 43 and layers[0].keys is not None
    assert mx.array_equal(keys[..., :40, :], layers[0].keys).item()
    assert mx.array_equal(keys[..., 40:, :], new_k).item()


def test_arena_reuses_given_back_buffers_without_stale_data_leaking() -> None:
    spec = make_spec()
    arena = KVArena(spec, max_idle_bytes=10**9)
    first = caches_to_blocks(random_layers(spec, 64, seed=1), list(range(64)), spec)
    second_layers = random_layers(spec, 20, seed=2)
    second = caches_to_blocks(second_layers, list(range(20)), spec)
    rebuilt = blocks_to_caches(first, 64, arena=arena)
    buffers = [(layer.keys, layer.values) for layer in rebuilt]
    ids = [id(k) for k, _ in buffers]
    arena.give_back(buffers)
    del rebuilt, buffers
    again = blocks_to_caches(second, 20, capacity=40, arena=arena)
    assert [id(layer.keys) for layer in again] == ids, "the idle buffers were handed out again"
    assert_same_kv(second_layers, again, 20)
    assert arena.idle_bytes == 0


def test_arena_buffers_have_a_block_of_headroom_so_the_next_longer_turn_reuses_them() -> None:
    spec = make_spec()
    arena = KVArena(spec, max_idle_bytes=10**9)
    block = spec.block_tokens
    first = arena.take(3 * block - 5)  # a turn just under three blocks
    assert int(first[0][0].shape[2]) == 4 * block
    ids = [id(k) for k, _ in first]
    arena.give_back(first)
    del first
    again = arena.take(3 * block + 10)  # the next turn, a little past three blocks
    assert [id(k) for k, _ in again] == ids, "the same buffers, no new allocation"


def test_arena_drops_idle_buffers_beyond_its_budget() -> None:
    spec = make_spec()
    arena = KVArena(spec, max_idle_bytes=32 * spec.bytes_per_token())
    arena.give_back(arena.take(32))
    arena.give_back(arena.take(64))
    assert arena.idle_bytes <= 32 * spec.bytes_per_token()


def test_slab_recycles_a_slot_only_once_nothing_refers_to_its_block() -> None:
    spec = make_spec()
    slab = BlockSlab(spec.bytes_per_block(), max_idle_slots=8)
    held = caches_to_blocks(random_layers(spec, 64), list(range(64)), spec, slab)
    dropped = caches_to_blocks(random_layers(spec, 64, seed=3), list(range(64)), spec, slab)
    held_copy = [np.array(k) for k in held.blocks[1].keys]
    dropped_ptrs = {b.keys[0].__array_interface__["data"][0] for b in dropped.blocks}
    only_a_layer = dropped.blocks[0].keys[2]  # one array keeps its whole slot lent
    del dropped
    gc.collect()
    third = caches_to_blocks(random_layers(spec, 64, seed=4), list(range(64)), spec, slab)
    third_ptrs = {b.keys[0].__array_interface__["data"][0] for b in third.blocks}
    assert len(third_ptrs & dropped_ptrs) == 1, "the free slot was reused, the one still referenced was not"
    assert all(np.array_equal(a, b) for a, b in zip(held_copy, held.blocks[1].keys, strict=True))
    assert only_a_layer.shape == (2, 32, 16)


def test_slab_slots_sit_half_a_page_past_a_boundary() -> None:
    slab = BlockSlab(10_000, 4)
    for slot in slab.take(3):
        assert slot.__array_interface__["data"][0] % PAGE == PAGE // 2


def test_copy_array_is_exact_when_source_and_destination_alias() -> None:
    raw = page_offset_array(3 * PAGE * 8, 0)
    source = raw[: PAGE * 4].view(np.float32).reshape(4, 1024)
    source[:] = np.arange(4096, dtype=np.float32).reshape(4, 1024)
    destination = raw[PAGE * 4 + 8 : PAGE * 8 + 8].view(np.float32).reshape(4, 1024)
    assert aliases(destination, source)
    copy_array(destination, source)
    assert np.array_equal(destination, np.arange(4096, dtype=np.float32).reshape(4, 1024))


def test_gather_of_a_truncated_cache_takes_only_the_prefix() -> None:
    spec = make_spec()
    layers = random_layers(spec, 80)
    cache: AgentCache = caches_to_blocks(layers, list(range(80)), spec)
    rebuilt = blocks_to_caches(cache, 50)
    assert all(layer.offset == 50 for layer in rebuilt)
    assert_same_kv(layers, rebuilt, 50)


@pytest.mark.parametrize("n_tokens", [33, 100])
def test_copies_split_over_two_threads_are_exact(monkeypatch: pytest.MonkeyPatch, n_tokens: int) -> None:
    monkeypatch.setattr(kv_convert, "PARALLEL_COPY_BYTES", 0)  # every extract and gather: two threads
    spec = make_spec(n_layers=5)  # odd: the halves differ in size
    layers = random_layers(spec, n_tokens)
    rebuilt = blocks_to_caches(caches_to_blocks(layers, list(range(n_tokens)), spec), n_tokens)
    assert_same_kv(layers, rebuilt, n_tokens)


def test_gather_is_exact_when_a_block_aliases_its_destination() -> None:
    heads, dim, block = 2, 16, 32
    destination = page_offset_array(heads * 64 * dim * 4, 0).view(np.float32).reshape(heads, 64, dim)
    destination[:] = 0
    sources = []
    for index in range(2):  # each block 8 bytes before its place in the destination, modulo a page
        piece = destination[:, index * block : (index + 1) * block]
        place = piece.__array_interface__["data"][0]
        source = page_offset_array(heads * block * dim * 4, (place - 8) % PAGE)
        source = source.view(np.float32).reshape(heads, block, dim)
        source[:] = np.random.default_rng(index).normal(size=source.shape)
        assert aliases(piece, source)
        sources.append(source)
    kv_convert._concatenate_into(destination, sources, 64)
    assert np.array_equal(destination, np.concatenate(sources, axis=1))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
def test_background_copies_yield_to_the_step_thread_only() -> None:
    seen: dict[str, int] = {}
    step_thread = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def background() -> None:
        kv_buffers.yield_to_the_step()
        seen["cut"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    thread = threading.Thread(target=background)
    thread.start()
    thread.join()
    assert seen["cut"] >= kv_buffers.BACKGROUND_NICE > step_thread
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == step_thread  # untouched
