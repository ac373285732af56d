"""Synthetic agent caches whose KV depends only on the tokens: the store's tests and benchmarks share them.

The KV of a position is a function of (position, token id) only, like a real model's for a fixed
prefix, so two caches that share a token prefix share those blocks byte for byte (what the store's
shared blocks and prefixes rely on), and a cache of other tokens differs everywhere.
"""

from __future__ import annotations

import numpy as np

from engine.core.blocks import NUMPY_STORAGE_DTYPE, AgentCache, KVBlock
from engine.core.spec import ModelCacheSpec


def kv_values(
    spec: ModelCacheSpec, layer: int, kind: int, positions: np.ndarray, tokens: np.ndarray
) -> np.ndarray:
    """(heads, n, dim) values in [-1, 1) determined by (layer, K/V, position, token)."""
    heads, dim = spec.n_kv_heads, spec.k_head_dim
    phase = (positions * 0.37 + tokens * 0.011 + layer * 1.3 + kind * 2.1)[None, :, None]
    grid = np.arange(heads)[:, None, None] * 0.7 + np.arange(dim)[None, None, :] * 0.05
    values = np.sin(phase + grid).astype(np.float32)
    if spec.dtype == "bfloat16":
        return (values.view(np.uint32) >> 16).astype(np.uint16)
    return values.astype(NUMPY_STORAGE_DTYPE[spec.dtype])


def make_cache(spec: ModelCacheSpec, token_ids: list[int]) -> AgentCache:
    tokens = np.asarray(token_ids, dtype=np.int64)
    blocks = []
    for start in range(0, len(tokens), spec.block_tokens):
        end = min(start + spec.block_tokens, len(tokens))
        positions = np.arange(start, end)
        chunk = tokens[start:end]
        blocks.append(
            KVBlock(
                keys=tuple(kv_values(spec, layer, 0, positions, chunk) for layer in range(spec.n_layers)),
                values=tuple(kv_values(spec, layer, 1, positions, chunk) for layer in range(spec.n_layers)),
            )
        )
    return AgentCache(spec, list(token_ids), blocks)


def tokens(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 50_000, size=n)]
