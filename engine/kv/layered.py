"""Blocks <-> mlx-lm caches for models whose layers are not all plain full attention.

engine/kv/convert.py sends every spec that is not `all_full_attention` here (sliding
windows, per-layer shapes, SSM / linear-attention state, CacheList hybrids). The cache
list is walked in the spec's leaf order (engine.core.spec: `kv_layers()`, `state_layers()`):
- full layers: every token, as in the plain path;
- sliding layers: only the last `window` tokens before the cache's end (what mlx-lm's
  RotatingKVCache keeps), each block holding those of its own tokens;
- state layers: the arrays after a block's last token, for blocks whose boundary the
  sequence passed while it ran (`checkpoints`, taken by engine/batch/checkpoints.py) or ended on.
A rebuilt RotatingKVCache holds the `window` tokens before the resume point, in order,
exactly what mlx-lm's own cache holds there; a rebuilt ArraysCache is the checkpoint.

Only the last KEEP_CHECKPOINTS checkpoints are kept: one costs every state layer's arrays
(147 MiB for Qwen3.5-27B, docs/models.md), as much as 2,300 tokens of its KV, so keeping one
per block would make the state, not the KV, what an agent's cache costs. Two let a turn that
rewrites the end of the history (a regenerated answer) resume within the last 512 tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from engine.core.blocks import AgentCache, KVBlock
from engine.core.errors import CacheMismatchError
from engine.core.spec import KVLayer, LayerSpec, ModelCacheSpec
from engine.kv.buffers import host_view, mlx_dtype
from engine.kv.fast_copy import copy_array
from engine.kv.window import WindowKVCache

Checkpoint = tuple[tuple[np.ndarray, ...], ...]  # per state layer, its arrays (host, storage dtype)

KEEP_CHECKPOINTS = 2


def leaf_caches(layers: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """(KV caches, ArraysCaches) of a model's cache list, CacheList members in place, in spec order."""
    from mlx_lm.models.cache import ArraysCache, CacheList

    kv: list[Any] = []
    states: list[Any] = []

    def visit(cache: Any) -> None:
        if isinstance(cache, CacheList):
            for member in cache.caches:
                visit(member)
        elif isinstance(cache, ArraysCache):
            states.append(cache)
        else:
            kv.append(cache)

    for cache in layers:
        visit(cache)
    return kv, states


def take_checkpoint(layers: Sequence[Any], spec: ModelCacheSpec) -> Checkpoint:
    """Host copies of every state layer's arrays (batch row 0) in the cache list `layers`."""
    _kv, states = leaf_caches(layers)
    arrays = [[a[0] for a in cache.cache] for cache in states]
    mx.eval(arrays)
    if len(arrays) != len(spec.state_layers()):
        raise RuntimeError(f"{len(arrays)} state caches for a spec of {len(spec.state_layers())}")
    return tuple(tuple(_host_copy(a) for a in layer_arrays) for layer_arrays in arrays)


def inherited_checkpoints(cache: AgentCache, reused: int) -> dict[int, Checkpoint]:
    """The checkpoints of `cache` a sequence resumed at `reused` still stands on."""
    out = {}
    for index, block in enumerate(cache.blocks):
        end = (index + 1) * cache.spec.block_tokens
        if block.states and end <= reused:
            out[end] = block.states
    return out


def _host_copy(array: mx.array) -> np.ndarray:
    if array.dtype == mx.bfloat16:
        array = array.view(mx.uint16)
    return np.array(array)


def _device(array: np.ndarray, dtype: str) -> mx.array:
    out = mx.array(array)
    return out.view(mx.bfloat16) if dtype == "bfloat16" else out


# ---- caches -> blocks ------------------------------------------------------------------------


def layered_caches_to_blocks(
    layers: Sequence[Any],
    token_ids: list[int],
    spec: ModelCacheSpec,
    checkpoints: Mapping[int, Checkpoint] | None = None,
    keep_checkpoints: int = KEEP_CHECKPOINTS,
) -> AgentCache:
    """Cut a finished sequence's caches into blocks: full layers whole, sliding layers' windows,
    the last `keep_checkpoints` state checkpoints of `checkpoints` (position -> checkpoint, plus
    the end when it is a block boundary)."""
    n_tokens = len(token_ids)
    if n_tokens == 0:
        return AgentCache(spec, [], [])
    kv_caches, _states = leaf_caches(layers)
    if len(kv_caches) != len(spec.kv_layers()):
        raise RuntimeError(f"{len(kv_caches)} KV caches for a spec of {len(spec.kv_layers())}")
    sources = [_ordered_kv(cache) for cache in kv_caches]
    mx.eval([(k, v) for k, v, _first in sources])
    host = [(_host_copy(k[0]), _host_copy(v[0]), first) for k, v, first in sources]
    checkpoints = dict(checkpoints or {})
    block_tokens = spec.block_tokens
    if spec.state_layers() and n_tokens and n_tokens % block_tokens == 0 and n_tokens not in checkpoints:
        checkpoints[n_tokens] = take_checkpoint(layers, spec)
    last = sorted(p for p in checkpoints if p <= n_tokens)[-keep_checkpoints:] if keep_checkpoints > 0 else []
    checkpoints = {p: checkpoints[p] for p in last}
    kept_from = [
        _kept_from(layer, first, n_tokens)
        for layer, (_k, _v, first) in zip(spec.kv_layers(), host, strict=True)
    ]
    blocks = []
    for start in range(0, n_tokens, block_tokens):
        end = min(start + block_tokens, n_tokens)
        keys, values = [], []
        for (k, v, first), kept in zip(host, kept_from, strict=True):
            lo = max(start, kept)
            if lo < first:
                raise RuntimeError(f"cache holds tokens from {first}, the block needs them from {lo}")
            keys.append(np.ascontiguousarray(k[:, lo - first : max(lo, end) - first]))
            values.append(np.ascontiguousarray(v[:, lo - first : max(lo, end) - first]))
        states = checkpoints.get(end, ()) if end - start == block_tokens else ()
        blocks.append(KVBlock(tuple(keys), tuple(values), states, tokens=end - start))
    return AgentCache(spec, list(token_ids), blocks)


def _kept_from(layer: KVLayer, first: int, n_tokens: int) -> int:
    """The first position a layer keeps: 0 for full attention, the window's start for sliding."""
    if layer.kind == "sliding" and layer.window is not None:
        return max(first, n_tokens - layer.window)
    return first


def _ordered_kv(cache: Any) -> tuple[mx.array, mx.array, int]:
    """(keys, values, position of their first token) of a KVCache, RotatingKVCache or WindowKVCache,
    in token order."""
    from mlx_lm.models.cache import RotatingKVCache

    if isinstance(cache, WindowKVCache):  # a ragged row's sliding layer
        return cache.ordered()
    keys, values, offset = cache.keys, cache.values, int(cache.offset)
    if keys is None:
        raise RuntimeError("an empty KV cache for a sequence that has tokens")
    if not isinstance(cache, RotatingKVCache):
        return keys[..., :offset, :], values[..., :offset, :], 0
    if cache.keep:
        raise RuntimeError("a RotatingKVCache with keep > 0 cannot be cut into blocks")
    length = int(keys.shape[2])
    if offset <= length:  # never wrapped: positions 0..offset-1 in place
        return keys[..., :offset, :], values[..., :offset, :], 0
    idx = int(cache._idx)
    if idx < length:  # wrapped: the oldest token sits at _idx
        keys = mx.concatenate([keys[..., idx:, :], keys[..., :idx, :]], axis=2)
        values = mx.concatenate([values[..., idx:, :], values[..., :idx, :]], axis=2)
    return keys, values, offset - length


# ---- blocks -> caches ------------------------------------------------------------------------


def layered_blocks_to_caches(cache: AgentCache, n_tokens: int) -> list[Any]:
    """The model's cache list holding the first `n_tokens` tokens of `cache` (a resume point:
    see AgentCache.resume_point); a fresh, empty cache list for 0."""
    spec = cache.spec
    n_tokens = min(n_tokens, cache.n_tokens)
    if n_tokens and n_tokens != cache.resume_point(n_tokens):
        raise CacheMismatchError(f"the cache cannot resume exactly at token {n_tokens}")
    kv = [_kv_cache(cache, layer, n_tokens) for layer in spec.kv_layers()]
    states = _state_caches(cache, n_tokens)
    kv_iter, state_iter = iter(kv), iter(states)
    return [_assemble(layer, kv_iter, state_iter) for layer in spec.layers]


def _assemble(layer: LayerSpec, kv: Any, states: Any) -> Any:
    from mlx_lm.models.cache import CacheList

    if layer.kind == "list":
        return CacheList(*(_assemble(part, kv, states) for part in layer.parts or ()))
    return next(states) if layer.kind == "state" else next(kv)


def _kv_cache(cache: AgentCache, layer: KVLayer, n_tokens: int) -> Any:
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    sliding = layer.kind == "sliding" and layer.window is not None
    out: Any = RotatingKVCache(max_size=layer.window) if sliding else KVCache()
    if n_tokens == 0:
        return out
    start = max(0, n_tokens - layer.window) if sliding and layer.window is not None else 0
    length = n_tokens - start
    capacity = length if sliding else -(-n_tokens // cache.spec.block_tokens) * cache.spec.block_tokens
    dtype = mlx_dtype(cache.spec)
    keys = mx.zeros((1, layer.n_kv_heads, capacity, layer.k_head_dim), dtype=dtype)
    values = mx.zeros((1, layer.n_kv_heads, capacity, layer.v_head_dim), dtype=dtype)
    mx.eval(keys, values)
    host_keys, host_values = host_view(keys)[0], host_view(values)[0]
    block_tokens = cache.spec.block_tokens
    for index, block in enumerate(cache.blocks):
        block_start = index * block_tokens
        held = int(block.keys[layer.index].shape[1])
        first = block_start + block.n_tokens - held  # position of the block's first held token
        lo, hi = max(first, start), min(block_start + block.n_tokens, n_tokens)
        if lo >= hi:
            continue
        copy_array(host_keys[:, lo - start : hi - start], block.keys[layer.index][:, lo - first : hi - first])
        copy_array(
            host_values[:, lo - start : hi - start], block.values[layer.index][:, lo - first : hi - first]
        )
    del host_keys, host_values
    out.keys, out.values, out.offset = keys, values, n_tokens
    if sliding:
        out._idx = length
    return out


def _state_caches(cache: AgentCache, n_tokens: int) -> list[Any]:
    from mlx_lm.models.cache import ArraysCache

    layers = cache.spec.state_layers()
    out = [ArraysCache(size=len(layer.shapes)) for layer in layers]
    if n_tokens == 0 or not layers:
        return out
    block = cache.blocks[n_tokens // cache.spec.block_tokens - 1]
    if n_tokens % cache.spec.block_tokens or not block.states:
        raise CacheMismatchError(f"no checkpoint of the SSM state at token {n_tokens}")
    for layer, arrays_cache, arrays in zip(layers, out, block.states, strict=True):
        restored: list[Any] = [_device(a, dtype)[None] for a, dtype in zip(arrays, layer.dtypes, strict=True)]
        arrays_cache.cache = restored
    return out
