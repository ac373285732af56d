"""Moving KV between MLX caches (what the model runs on) and blocks (what is budgeted and stored).

Both directions are one copy at memory speed, through numpy views of MLX buffers:
- gather: each layer's cache buffer is allocated once at its final capacity (a multiple
  of 256 tokens) and the blocks are copied straight into it through a writable numpy view:
  one numpy call per layer and K/V, large caches split over two threads. The buffers come
  from a KVArena (those of ended sequences) where it has some, else from MLX's allocator,
  which keeps freed buffers for reuse only up to its cache limit (32 MB by default):
  `keep_buffers_resident` raises that limit, else such a gather pays fresh pages, several
  times the copy itself.
- extract: a finished cache is copied block by block into slots of a BlockSlab (recycled
  host memory), each block one contiguous (layers, heads, tokens, dim) region per K and V;
  large caches split their blocks over two threads.

Python loops run per block and layer, never per token. Specs that are not plain full
attention (sliding windows, per-layer shapes, SSM state) go to engine/kv/layered.py.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import mlx.core as mx
import numpy as np

from engine.core.blocks import NUMPY_STORAGE_DTYPE, AgentCache, KVBlock
from engine.core.spec import ModelCacheSpec
from engine.kv.arena import KVArena
from engine.kv.buffers import empty_layer_buffers, host_view, round_up, yield_to_the_step
from engine.kv.fast_copy import address, aliases_at, copy_array
from engine.kv.host_slab import BlockSlab
from engine.kv.layered import Checkpoint, layered_blocks_to_caches, layered_caches_to_blocks


def blocks_to_caches(
    cache: AgentCache, n_tokens: int, capacity: int = 0, arena: KVArena | None = None
) -> list[Any]:
    """One mlx-lm KVCache per layer holding the first `n_tokens` tokens of `cache`.

    Each layer's buffer holds at least max(n_tokens, capacity) tokens, whole blocks, so a
    sequence that knows how far it will grow never reallocates its cache. With an arena,
    the buffers come from earlier sequences and need no fresh memory.
    """
    from mlx_lm.models.cache import KVCache

    spec = cache.spec
    if not spec.all_full_attention:
        return layered_blocks_to_caches(cache, n_tokens)
    n_tokens = min(n_tokens, cache.n_tokens)
    layers: list[Any] = [KVCache() for _ in range(spec.n_layers)]
    if n_tokens <= 0:
        return layers
    wanted = max(n_tokens, capacity)
    buffers = (
        arena.take(wanted)
        if arena is not None
        else empty_layer_buffers(spec, round_up(wanted, spec.block_tokens))
    )
    hosts = [(host_view(keys)[0], host_view(values)[0]) for keys, values in buffers]  # MLX calls: here
    blocks = cache.truncated(n_tokens).blocks  # views: the last one cut to n_tokens

    def gather_layers(layer_ids: range) -> None:
        for layer in layer_ids:
            host_keys, host_values = hosts[layer]
            _concatenate_into(host_keys, [block.keys[layer] for block in blocks], n_tokens)
            _concatenate_into(host_values, [block.values[layer] for block in blocks], n_tokens)

    _split_over_two_threads(gather_layers, spec.n_layers, cache.nbytes)
    hosts.clear()  # drop the views: while one lives, MLX copies the buffer instead of updating it
    for layer, (keys, values) in enumerate(buffers):
        layers[layer].keys, layers[layer].values = keys, values
        layers[layer].offset = n_tokens
    return layers


# A copy this large (the KV of ~180 SmolLM2 tokens) is split over two threads: numpy
# releases the GIL while it copies, and one core alone does not reach the memory's
# bandwidth (8K tokens: 0.44 of a memcpy on one thread, 0.8 on two).
PARALLEL_COPY_BYTES = 8 * 1024 * 1024
_copy_pools: dict[bool, ThreadPoolExecutor] = {}
_copy_pools_lock = threading.Lock()


def _split_over_two_threads(
    work: Callable[[range], None], n_items: int, n_bytes: int, background: bool = False
) -> None:
    """work(range) over 0..n_items, the second half on a helper thread when the copy is large
    (a `background` copy's helper yields to the step like its caller)."""
    if n_bytes < PARALLEL_COPY_BYTES or n_items < 2:
        work(range(n_items))
        return
    with _copy_pools_lock:
        pool = _copy_pools.get(background)
        if pool is None:
            initializer = yield_to_the_step if background else None
            pool = ThreadPoolExecutor(1, thread_name_prefix="kvrq-copy", initializer=initializer)
            _copy_pools[background] = pool
    half = n_items // 2
    other = pool.submit(work, range(half, n_items))
    try:
        work(range(half))
    finally:
        other.result()


def _concatenate_into(destination: np.ndarray, sources: list[np.ndarray], n_tokens: int) -> None:
    """Copy `sources` (heads, tokens_i, dim) side by side into destination[:, :n_tokens]: one
    numpy call, unless a piece would hit 4K aliasing (engine/kv/fast_copy.py), then piece by piece."""
    target = destination[:, :n_tokens]
    row_bytes, base = destination.strides[1], address(destination)
    offset, aliased = 0, False
    for source in sources:
        aliased = aliased or aliases_at(base + offset * row_bytes, source)
        offset += source.shape[1]
    if not aliased:
        np.concatenate(sources, axis=1, out=target)
        return
    offset = 0
    for source in sources:
        copy_array(target[:, offset : offset + source.shape[1]], source)
        offset += source.shape[1]


def caches_to_blocks(
    layers: list[Any],
    token_ids: list[int],
    spec: ModelCacheSpec,
    slab: BlockSlab | None = None,
    checkpoints: Mapping[int, Checkpoint] | None = None,
) -> AgentCache:
    """Copy the first len(token_ids) tokens of per-layer caches into blocks of host arrays.

    `layers` are mlx-lm KVCaches (or anything with keys/values of shape (1, heads, >=n, dim)).
    With a slab, the blocks' memory is recycled from earlier extracts. `checkpoints` (SSM
    state taken at block ends while the sequence ran) only matter to specs with state layers.
    """
    if not spec.all_full_attention:
        return layered_caches_to_blocks(layers, token_ids, spec, checkpoints)
    host = host_layers(layers, len(token_ids), spec)
    return copy_into_blocks(host, token_ids, spec, slab)


HostLayers = list[tuple[np.ndarray, np.ndarray]]


def host_layers(layers: list[Any], n_tokens: int, spec: ModelCacheSpec) -> HostLayers:
    """Zero-copy (heads, tokens, dim) numpy views of each layer's evaluated K and V.

    The only MLX calls of an extract: run them on the thread that runs the model, then
    copy_into_blocks (numpy only, the GIL released while it copies) may run on another.
    """
    sources = [_layer_arrays(layer) for layer in layers]
    mx.eval(sources)
    if len(sources) != spec.n_layers:
        raise RuntimeError(f"{len(sources)} cache layers for a spec of {spec.n_layers}")
    host = [(host_view(keys)[0], host_view(values)[0]) for keys, values in sources]
    for keys, _ in host:
        if keys.shape[1] < n_tokens:
            raise RuntimeError(f"cache holds {keys.shape[1]} tokens but the sequence has {n_tokens}")
    return host


def copy_into_blocks(
    host: HostLayers,
    token_ids: list[int],
    spec: ModelCacheSpec,
    slab: BlockSlab | None = None,
    background: bool = False,
) -> AgentCache:
    """Copy the first len(token_ids) tokens of host K/V views into blocks (slab slots if given);
    `background`: the caller runs beside the model's step (its helper thread yields like it)."""
    n_tokens = len(token_ids)
    n_blocks = spec.blocks_for(n_tokens)
    slots = (
        slab.take(n_blocks)
        if slab is not None
        else [np.empty(spec.bytes_per_block(), dtype=np.uint8) for _ in range(n_blocks)]
    )
    blocks = []
    for index, slot in enumerate(slots):
        start = index * spec.block_tokens
        blocks.append(_block_in_slot(slot, spec, min(spec.block_tokens, n_tokens - start)))

    def fill(block_ids: range) -> None:
        for index in block_ids:
            block, start = blocks[index], index * spec.block_tokens
            take = block.n_tokens
            for layer, (keys, values) in enumerate(host):
                copy_array(block.keys[layer], keys[:, start : start + take])
                copy_array(block.values[layer], values[:, start : start + take])

    _split_over_two_threads(fill, len(blocks), n_tokens * spec.bytes_per_token(), background)
    return AgentCache(spec, list(token_ids), blocks)


def _layer_arrays(layer: Any) -> tuple[mx.array, mx.array]:
    keys = getattr(layer, "keys", None)
    values = getattr(layer, "values", None)
    if isinstance(keys, mx.array) and isinstance(values, mx.array):
        return keys, values
    state = layer.state
    return state[0], state[1]


def _block_in_slot(slot: np.ndarray, spec: ModelCacheSpec, n_tokens: int) -> KVBlock:
    """A block of n_tokens laid out in `slot`: all layers' keys, then all layers' values,
    each (heads, n_tokens, dim) array contiguous."""
    dtype = np.dtype(NUMPY_STORAGE_DTYPE[spec.dtype])
    heads = spec.n_kv_heads
    key_bytes = spec.n_layers * heads * n_tokens * spec.k_head_dim * dtype.itemsize
    value_bytes = spec.n_layers * heads * n_tokens * spec.v_head_dim * dtype.itemsize
    keys = slot[:key_bytes].view(dtype).reshape(spec.n_layers, heads, n_tokens, spec.k_head_dim)
    values = (
        slot[key_bytes : key_bytes + value_bytes]
        .view(dtype)
        .reshape(spec.n_layers, heads, n_tokens, spec.v_head_dim)
    )
    return KVBlock(keys=tuple(keys), values=tuple(values))
