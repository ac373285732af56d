"""One layer's attention calls for the ragged step, and MLX's fused attention for them.

Why its own module: the ragged step (engine/batch/ragged.py) builds a layer's calls, and the
CPU acceleration (engine/cpu/split_attention.py) takes them where it can; both need the call's
shape without needing each other. Everything that is not taken there (Metal, CUDA, attention
sinks, other dtypes, the shortcuts off) runs `fused_attention`, MLX's own kernel per call.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class AttentionCall:
    queries: mx.array  # (batch, heads, queries, dim)
    keys: mx.array  # (batch, kv_heads, keys, dim)
    values: mx.array  # (batch, kv_heads, keys, value_dim)
    # "causal": the queries are the last tokens of the keys; a bool (batch, 1, 1, keys)
    # array: True where a key may be attended; None: every key.
    mask: mx.array | str | None = None
    # Where the mask keeps a prefix of each batch row's keys: their lengths (the ShortSlots'
    # call); lets decoding rows skip the mask (engine/cpu/native_attention.py).
    prefix_lengths: tuple[int, ...] | None = None


def fused_attention(calls: list[AttentionCall], scale: float, sinks: mx.array | None) -> list[mx.array]:
    """Each call's attention output by `mx.fast.scaled_dot_product_attention`, in order."""
    fused = mx.fast.scaled_dot_product_attention
    return [fused(c.queries, c.keys, c.values, scale=scale, mask=c.mask, sinks=sinks) for c in calls]


QuantizedParts = tuple[mx.array, mx.array, mx.array]  # packed uint32, scales, biases


@dataclass(frozen=True)
class QuantizedCall:
    """A row's attention over K/V held quantized (a pool with kv_bits): (1, kv_heads, keys, ...) parts."""

    queries: mx.array  # (batch, heads, queries, dim)
    keys: QuantizedParts
    values: QuantizedParts
    bits: int
    group_size: int
    mask: str | None = None  # "causal" (the queries are the last keys' tokens) or None


def quantized_attention(calls: list[QuantizedCall], scale: float, sinks: mx.array | None) -> list[mx.array]:
    """Each call's attention output by quantized matmuls (mlx-lm's quantized attention): the K/V
    are read packed, never dequantized into a buffer; the same on every device. (mlx-lm's function
    scales the queries array it is given in place: each call's queries must be its own, as the ragged
    step's per-row runs are.)"""
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    if sinks is not None:
        raise ValueError("attention sinks are not supported over quantized K/V")
    return [
        quantized_scaled_dot_product_attention(
            c.queries,
            c.keys,
            c.values,
            scale=scale,
            mask=c.mask,  # type: ignore[arg-type]  # it takes "causal" too
            group_size=c.group_size,
            bits=c.bits,
        )
        for c in calls
    ]
