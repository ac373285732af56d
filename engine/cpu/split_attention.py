"""One layer's attention calls on the CPU, with the softmax outside MLX.

Why: MLX's CPU `exp` (a Cephes polynomial) runs one element at a time on this build,
15-23 ns per float32 element against numpy's vectorized 1-3 ns, and attention over many
scores is dominated by it. A warm agent's 17 suffix tokens over 8K of history took 25.7 ms
per layer with `mx.fast.scaled_dot_product_attention` and 8.1 ms split this way; 16 short
rows decoding over 512 tokens 4.8 vs 2.8 ms (docs/platform.md). So on the CPU a layer's
calls run in three parts: all their scores (MLX matmuls), evaluated together (one sync per
layer), the masked softmax's exponentials in C (engine/cpu/native/softmax_rows.c: two passes over
the scores, 3x faster than numpy's four for a suffix over 8K keys) or, where it cannot be built
or for a boolean mask, in numpy, then the weighted sum of the values (MLX matmuls) divided by
the exponentials' sums.
Decoding rows (one query token over all their keys, or over a known prefix: the ShortSlots')
go to one C call for all of them instead (engine/cpu/native_attention.py), where it could be built.
Elsewhere (Metal, CUDA, outside the ragged step), with attention sinks, or for other dtypes
than float32, `attend` declines and the batch takes MLX's fused call (engine/batch/attention.py).

Guarantee: the same attention up to float32 rounding (max difference ~5e-7 on unit-scale
inputs): greedy tokens equal mlx_lm.generate's in the parity tests. KVRQ_NUMPY_EXP=0
turns the split off, KVRQ_NATIVE_ATTENTION=0 the C parts (engine/cpu/shortcuts.py).
"""

from __future__ import annotations

import ctypes
import functools
import itertools

import mlx.core as mx
import numpy as np

from engine.batch.attention import AttentionCall, fused_attention
from engine.cpu import native_attention
from engine.cpu.shortcuts import current


def attend(calls: list[AttentionCall], scale: float, sinks: mx.array | None) -> list[mx.array] | None:
    """Each call's attention output, (batch, heads, queries, value_dim), in order; None where the
    step's shortcuts take none of them (the caller's fused call then)."""
    shortcuts = current()
    if sinks is not None or any(c.queries.dtype != mx.float32 for c in calls):
        return None
    lib = native_attention.loaded() if shortcuts.native_attention else None
    native = [i for i, call in enumerate(calls) if lib is not None and native_attention.fits(call)]
    if not shortcuts.numpy_exp and not native:
        return None
    native_set = set(native)
    rest = [i for i in range(len(calls)) if i not in native_set]
    split = rest if shortcuts.numpy_exp else []
    scores = [_scores(calls[i], scale) for i in split]
    masks = [calls[i].mask for i in split if isinstance(calls[i].mask, mx.array)]
    mx.eval(scores, masks, [(calls[i].queries, calls[i].keys, calls[i].values) for i in native])
    outputs: list[mx.array] = [mx.array(0)] * len(calls)
    if lib is not None and native:
        rows = native_attention.attend_decode_rows(lib, [calls[i] for i in native], scale)
        sizes = [calls[i].queries.shape[0] for i in native]
        parts = mx.split(rows, list(itertools.accumulate(sizes[:-1])), axis=0) if len(native) > 1 else [rows]
        for i, part in zip(native, parts, strict=True):
            outputs[i] = part
    if not shortcuts.numpy_exp:  # the C loop took the decoding rows; MLX's fused call the rest
        for i, output in zip(rest, fused_attention([calls[i] for i in rest], scale, sinks), strict=True):
            outputs[i] = output
        return outputs
    for i, weights in zip(split, scores, strict=True):
        call = calls[i]
        totals = _exp_in_place(np.asarray(weights), call, lib)
        batch, heads, length, _ = call.queries.shape
        # Normalized after the weighted sum: one division per output value instead of per score
        # (a pass over queries x keys, 2.5 MB a layer for a 17-token suffix over 4K keys).
        weighted = (weights @ call.values) / mx.array(totals)
        outputs[i] = weighted.reshape(batch, heads, length, call.values.shape[-1])
    return outputs


def _scores(call: AttentionCall, scale: float) -> mx.array:
    """(batch, kv_heads, repeats * queries, keys): the query heads sharing a KV head are
    stacked so that each KV head is one matmul (what grouped-query attention means)."""
    batch, heads, length, dim = call.queries.shape
    kv_heads = call.keys.shape[1]
    queries = (call.queries * mx.array(scale, call.queries.dtype)).reshape(batch, kv_heads, -1, dim)
    return queries @ call.keys.swapaxes(-1, -2)


def _exp_in_place(scores: np.ndarray, call: AttentionCall, lib: ctypes.CDLL | None) -> np.ndarray:
    """The masked softmax's numerators over the last axis, written over the scores; returns
    their sums (the denominators, keepdims), which the caller divides the output by. In C
    where it is built (two passes instead of numpy's four; 3x faster for a suffix over 8K keys),
    else in numpy; a boolean mask array always in numpy.

    `scores` is numpy's view of the evaluated MLX array that only this step holds (a
    matmul's fresh output), so writing it in place is what MLX's numpy interop documents
    and spares a copy out and a copy back (two passes of five for 8K keys)."""
    if lib is not None and not isinstance(call.mask, mx.array):
        queries = call.queries.shape[2] if isinstance(call.mask, str) else 1
        native_totals = native_attention.softmax_numerators(lib, scores, queries)
        if native_totals is not None:
            return native_totals
    if isinstance(call.mask, mx.array):
        np.copyto(scores, np.float32(-np.inf), where=np.logical_not(np.asarray(call.mask)))
    elif isinstance(call.mask, str) and call.queries.shape[2] > 1:
        length = call.queries.shape[2]
        per_query = scores.reshape(*scores.shape[:2], -1, length, scores.shape[-1])
        per_query[..., -length:] += _causal_block(length, scores.dtype)
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    totals: np.ndarray = scores.sum(axis=-1, keepdims=True)
    return totals


@functools.lru_cache(maxsize=8)
def _causal_block(length: int, dtype: np.dtype) -> np.ndarray:
    """(length, length): 0 on and below the diagonal, -inf above (query i sees keys <= i).
    Cached: every layer of a step asks for the same one, and it is only ever read."""
    return np.triu(np.full((length, length), -np.inf, dtype=dtype), k=1)
