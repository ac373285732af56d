"""Quantized KV between blocks and the running batch, and conversions of whole caches.

Why: a pool with `kv_bits` keeps every running row's K/V quantized (mlx-lm's QuantizedKVCache,
attended with quantized matmuls) and cuts finished rows into quantized blocks (KVBlock.quant),
so the same memory holds ~2x (8 bits) / ~3.5x (4 bits) the tokens of fp16, and an agent's
blocks go to and from a store quantized the same way without any conversion.

A cache arriving at another precision than the pool's (a saved fp cache resumed into a
quantized pool, or the other way) is converted once, whole, when it is submitted
(`convert_cache`): with the same rule the store uses (engine/kv/quant.py), block by block.
Only full-attention specs (the ragged batch's) are quantized here.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from engine.core.blocks import NUMPY_STORAGE_DTYPE, AgentCache, KVBlock, QuantParts
from engine.core.spec import ModelCacheSpec
from engine.kv.buffers import host_view, mlx_dtype, round_up
from engine.kv.quant import KVQuant, dequantize, quantize


def quantized_bytes_per_block(spec: ModelCacheSpec, quant: KVQuant) -> int:
    """Bytes of one full block held quantized (what the pool budgets per block)."""
    per_token = spec.n_layers * spec.n_kv_heads
    per_token *= quant.bytes_per_vector(spec.k_head_dim, spec.dtype_bytes) + quant.bytes_per_vector(
        spec.v_head_dim, spec.dtype_bytes
    )
    return per_token * spec.block_tokens


# ---- whole caches ----------------------------------------------------------------------------


def convert_cache(cache: AgentCache, quant: KVQuant | None) -> AgentCache:
    """`cache` at the precision `quant` names (None: full precision); itself when it already is."""
    held = cache.quantization
    wanted = None if quant is None else (quant.bits, quant.group_size)
    if held == wanted:
        return cache
    if held is not None:
        cache = dequantize_cache(cache)
    return cache if quant is None else quantize_cache(cache, quant)


def quantize_cache(cache: AgentCache, quant: KVQuant) -> AgentCache:
    spec = cache.spec
    blocks = []
    for block in cache.blocks:
        keys = quantize(np.stack(block.keys), spec.dtype, quant.bits, quant.group_size)
        values = quantize(np.stack(block.values), spec.dtype, quant.bits, quant.group_size)
        blocks.append(quantized_block(keys, values, quant))
    return AgentCache(spec, list(cache.token_ids), blocks)


def quantized_block(
    keys: tuple[np.ndarray, np.ndarray, np.ndarray],
    values: tuple[np.ndarray, np.ndarray, np.ndarray],
    quant: KVQuant,
) -> KVBlock:
    """A block from stacked (layers, heads, tokens, ...) packed values, scales and biases of K and V."""
    parts = QuantParts(
        quant.bits, quant.group_size, tuple(keys[1]), tuple(keys[2]), tuple(values[1]), tuple(values[2])
    )
    return KVBlock(keys=tuple(keys[0]), values=tuple(values[0]), quant=parts)


def dequantize_cache(cache: AgentCache) -> AgentCache:
    spec = cache.spec
    blocks = []
    for block in cache.blocks:
        quant = block.quant
        if quant is None:
            blocks.append(block)
            continue
        keys = _dequantized(spec, quant, block.keys, quant.key_scales, quant.key_biases)
        values = _dequantized(spec, quant, block.values, quant.value_scales, quant.value_biases)
        blocks.append(KVBlock(keys=keys, values=values))
    return AgentCache(spec, list(cache.token_ids), blocks)


def _dequantized(
    spec: ModelCacheSpec, quant: QuantParts, *parts: tuple[np.ndarray, ...]
) -> tuple[np.ndarray, ...]:
    """Per layer, the full-precision arrays of one kind (K or V) of a block: (packed, scales, biases)."""
    stored, scales, biases = (np.stack(part) for part in parts)
    return tuple(dequantize(stored, scales, biases, spec.dtype, quant.bits, quant.group_size))


# ---- blocks -> running rows ------------------------------------------------------------------


def empty_quantized_caches(spec: ModelCacheSpec, quant: KVQuant, capacity: int) -> list[Any]:
    """One empty QuantizedKVCache per layer with room for `capacity` tokens (whole blocks): a row
    that knows how far it grows never reallocates."""
    from mlx_lm.models.cache import QuantizedKVCache

    layers = []
    tokens = round_up(max(1, capacity), spec.block_tokens)
    buffers = []
    for _ in range(spec.n_layers):
        layer = QuantizedKVCache(group_size=quant.group_size, bits=quant.bits)
        layer.keys = _empty_parts(spec, quant, tokens, spec.k_head_dim)  # type: ignore[assignment]
        layer.values = _empty_parts(spec, quant, tokens, spec.v_head_dim)  # type: ignore[assignment]
        buffers += [layer.keys, layer.values]
        layers.append(layer)
    mx.eval(buffers)
    return layers


def _empty_parts(spec: ModelCacheSpec, quant: KVQuant, tokens: int, dim: int) -> tuple[mx.array, ...]:
    shape = (1, spec.n_kv_heads, tokens)
    dtype = mlx_dtype(spec)
    return (
        mx.zeros((*shape, quant.packed_dim(dim)), dtype=mx.uint32),
        mx.zeros((*shape, quant.groups(dim)), dtype=dtype),
        mx.zeros((*shape, quant.groups(dim)), dtype=dtype),
    )


def blocks_to_quantized_caches(cache: AgentCache, n_tokens: int, quant: KVQuant, capacity: int) -> list[Any]:
    """QuantizedKVCaches holding the first `n_tokens` tokens of a cache quantized as `quant`."""
    if cache.quantization != (quant.bits, quant.group_size):
        raise ValueError(f"a cache quantized as {cache.quantization} cannot fill a {quant.name} row")
    n_tokens = min(n_tokens, cache.n_tokens)
    layers = empty_quantized_caches(cache.spec, quant, max(n_tokens, capacity))
    if n_tokens <= 0:
        return layers
    blocks = cache.truncated(n_tokens).blocks
    for index, layer in enumerate(layers):
        for kind, buffers in (("k", layer.keys), ("v", layer.values)):
            sources = _block_parts(blocks, index, kind)
            for buffer, parts in zip(buffers, sources, strict=True):
                np.concatenate(parts, axis=1, out=host_view(buffer)[0][:, :n_tokens])
        layer.offset = n_tokens
    return layers


def _block_parts(blocks: list[KVBlock], layer: int, kind: str) -> list[list[np.ndarray]]:
    """[packed, scales, biases] of one layer's K ("k") or V, each as the blocks' arrays in order."""
    out: list[list[np.ndarray]] = [[], [], []]
    for block in blocks:
        quant = block.quant
        assert quant is not None
        if kind == "k":
            parts = (block.keys[layer], quant.key_scales[layer], quant.key_biases[layer])
        else:
            parts = (block.values[layer], quant.value_scales[layer], quant.value_biases[layer])
        for bucket, part in zip(out, parts, strict=True):
            bucket.append(part)
    return out


# ---- running rows -> blocks ------------------------------------------------------------------

QuantizedHost = list[tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]]


def quantized_host_layers(layers: list[Any], n_tokens: int) -> QuantizedHost:
    """Zero-copy numpy views (heads, tokens, ...) of each QuantizedKVCache's packed values, scales
    and biases: the MLX calls of a cut, on the model's thread; the copy may run elsewhere."""
    arrays = [(layer.keys, layer.values) for layer in layers]
    mx.eval(arrays)
    host = []
    for keys, values in arrays:
        if keys[0].shape[2] < n_tokens:
            raise RuntimeError(f"cache holds {keys[0].shape[2]} tokens but the sequence has {n_tokens}")
        host.append((tuple(host_view(a)[0] for a in keys), tuple(host_view(a)[0] for a in values)))
    return host


def copy_quantized_into_blocks(
    host: QuantizedHost, token_ids: list[int], spec: ModelCacheSpec, quant: KVQuant
) -> AgentCache:
    """Quantized blocks (copies) of the first len(token_ids) tokens of host views."""
    storage = np.dtype(NUMPY_STORAGE_DTYPE[spec.dtype])
    blocks = []
    for start in range(0, len(token_ids), spec.block_tokens):
        end = min(start + spec.block_tokens, len(token_ids))

        def stacked(which: int, part: int, start: int = start, end: int = end) -> np.ndarray:
            out = np.stack([layer[which][part][:, start:end] for layer in host])
            return out if part == 0 else out.view(storage)

        keys = (stacked(0, 0), stacked(0, 1), stacked(0, 2))
        values = (stacked(1, 0), stacked(1, 1), stacked(1, 2))
        blocks.append(quantized_block(keys, values, quant))
    return AgentCache(spec, list(token_ids), blocks)


# ---- single blocks (the store's encode of a block held at another precision) -----------------


def dequantize_block(block: KVBlock, spec: ModelCacheSpec) -> KVBlock:
    """A quantized block at full precision (a full-precision block as it is)."""
    (out,) = dequantize_cache(AgentCache(spec, [0] * block.n_tokens, [block])).blocks
    return out
