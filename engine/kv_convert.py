"""Moving KV between MLX caches (what the model runs on) and blocks (what is budgeted and stored).

Both directions go through numpy: on the CPU backend MLX's own concatenate and
strided copies run at about a fifth of memcpy speed, numpy at several times that.
np.asarray of an evaluated MLX array is a zero-copy view, so extracting a block costs
one copy, and gathering costs a numpy concatenate plus the copy into MLX.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from engine.blocks import AgentCache, KVBlock
from engine.spec import ModelCacheSpec

_MX_DTYPE = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def _to_host(array: mx.array) -> np.ndarray:
    """Zero-copy numpy view of an evaluated MLX array (bfloat16 as its uint16 bits)."""
    if array.dtype == mx.bfloat16:
        array = array.view(mx.uint16)
    return np.asarray(array)


def _to_device(array: np.ndarray, dtype: str) -> mx.array:
    out = mx.array(array)
    return out.view(mx.bfloat16) if dtype == "bfloat16" else out


def blocks_to_caches(cache: AgentCache, n_tokens: int) -> list[Any]:
    """Rebuild one mlx-lm KVCache per layer holding the first `n_tokens` tokens of `cache`."""
    from mlx_lm.models.cache import KVCache

    spec = cache.spec
    prefix = cache.truncated(n_tokens)
    layers: list[Any] = []
    for layer in range(spec.n_layers):
        layer_cache = KVCache()
        if n_tokens > 0:
            keys = np.concatenate([b.keys[layer] for b in prefix.blocks], axis=1)[None]
            values = np.concatenate([b.values[layer] for b in prefix.blocks], axis=1)[None]
            layer_cache.state = (_to_device(keys, spec.dtype), _to_device(values, spec.dtype), n_tokens)
        layers.append(layer_cache)
    mx.eval([c.state[:2] for c in layers if c.keys is not None])
    return layers


def caches_to_blocks(layers: list[Any], token_ids: list[int], spec: ModelCacheSpec) -> AgentCache:
    """Cut a finished sequence's per-layer KVCache into 256-token blocks of host arrays."""
    n_tokens = len(token_ids)
    states = [layer.state for layer in layers]
    mx.eval([s[:2] for s in states])
    host_keys = [_to_host(s[0])[0] for s in states]
    host_values = [_to_host(s[1])[0] for s in states]
    for k in host_keys:
        if k.shape[1] < n_tokens:
            raise RuntimeError(f"cache holds {k.shape[1]} tokens but the sequence has {n_tokens}")
    blocks: list[KVBlock] = []
    for start in range(0, n_tokens, spec.block_tokens):
        end = min(start + spec.block_tokens, n_tokens)
        blocks.append(
            KVBlock(
                keys=tuple(np.ascontiguousarray(k[:, start:end]) for k in host_keys),
                values=tuple(np.ascontiguousarray(v[:, start:end]) for v in host_values),
            )
        )
    return AgentCache(spec, list(token_ids), blocks)
