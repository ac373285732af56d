"""Moving KV between MLX caches (what the model runs on) and blocks (what is budgeted and stored).

Both directions go through numpy: on the CPU backend MLX's own concatenate and
strided copies run at about a fifth of memcpy speed, numpy at several times that.
np.asarray of an evaluated MLX array is a zero-copy view, so extracting a block costs
one copy, and gathering costs a numpy concatenate plus the copy into MLX.
"""

from __future__ import annotations

import threading
from typing import Any

import mlx.core as mx
import numpy as np

from engine.blocks import AgentCache, KVBlock
from engine.spec import ModelCacheSpec


def _to_host(array: mx.array) -> np.ndarray:
    """Zero-copy numpy view of an evaluated MLX array (bfloat16 as its uint16 bits)."""
    if array.dtype == mx.bfloat16:
        array = array.view(mx.uint16)
    return np.asarray(array)


class _Scratch(threading.local):
    """A reused host buffer for gathering: fresh memory costs page faults that cost
    more than the copy itself (about 1 GB/s here against 8 GB/s for warm memory)."""

    buffer: np.ndarray | None = None

    def take(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
        size = int(np.prod(shape)) * dtype.itemsize
        if self.buffer is None or self.buffer.nbytes < size:
            self.buffer = np.empty(size, dtype=np.uint8)
        return self.buffer[:size].view(dtype).reshape(shape)


_scratch = _Scratch()


def _gather(parts: list[np.ndarray], n_tokens: int) -> mx.array:
    heads, _, dim = parts[0].shape
    out = _scratch.take((1, heads, n_tokens, dim), parts[0].dtype)
    np.concatenate(parts, axis=1, out=out[0])
    return mx.array(out)


def blocks_to_caches(cache: AgentCache, n_tokens: int) -> list[Any]:
    """Rebuild one mlx-lm KVCache per layer holding the first `n_tokens` tokens of `cache`."""
    from mlx_lm.models.cache import KVCache

    spec = cache.spec
    prefix = cache.truncated(n_tokens)
    layers: list[Any] = []
    for layer in range(spec.n_layers):
        layer_cache = KVCache()
        if n_tokens > 0:
            keys = _gather([b.keys[layer] for b in prefix.blocks], n_tokens)
            values = _gather([b.values[layer] for b in prefix.blocks], n_tokens)
            if spec.dtype == "bfloat16":
                keys, values = keys.view(mx.bfloat16), values.view(mx.bfloat16)
            layer_cache.state = (keys, values, n_tokens)
            mx.eval(keys, values)  # before the scratch buffer is reused for the next array
        layers.append(layer_cache)
    return layers


def caches_to_blocks(layers: list[Any], token_ids: list[int], spec: ModelCacheSpec) -> AgentCache:
    """Cut a finished sequence's per-layer KVCache into 256-token blocks of host arrays.

    Full blocks of one layer share a single (n_blocks, heads, 256, dim) allocation, so
    a cache costs two large allocations per layer instead of one per block: large
    freed allocations are reused by the allocator, small ones each pay fresh pages.
    """
    n_tokens = len(token_ids)
    states = [layer.state for layer in layers]
    mx.eval([s[:2] for s in states])
    per_layer = []
    for state in states:
        keys, values = _to_host(state[0])[0], _to_host(state[1])[0]
        if keys.shape[1] < n_tokens:
            raise RuntimeError(f"cache holds {keys.shape[1]} tokens but the sequence has {n_tokens}")
        per_layer.append(
            (_split(keys, n_tokens, spec.block_tokens), _split(values, n_tokens, spec.block_tokens))
        )
    n_blocks = spec.blocks_for(n_tokens)
    blocks = [
        KVBlock(keys=tuple(k[i] for k, _ in per_layer), values=tuple(v[i] for _, v in per_layer))
        for i in range(n_blocks)
    ]
    return AgentCache(spec, list(token_ids), blocks)


def _split(array: np.ndarray, n_tokens: int, block_tokens: int) -> list[np.ndarray]:
    """(heads, T, dim) -> contiguous (heads, <=block_tokens, dim) pieces covering n_tokens."""
    heads, _, dim = array.shape
    n_full = n_tokens // block_tokens
    full = np.empty((n_full, heads, block_tokens, dim), dtype=array.dtype)
    source = array[:, : n_full * block_tokens].reshape(heads, n_full, block_tokens, dim)
    np.copyto(full, source.transpose(1, 0, 2, 3))
    pieces = list(full)
    if n_tokens > n_full * block_tokens:
        pieces.append(np.ascontiguousarray(array[:, n_full * block_tokens : n_tokens]))
    return pieces
