"""Decoding rows' attention over quantized K/V (a pool with kv_bits) in one C call a layer.

Why: MLX's CPU quantized matmul reads packed K/V no faster than float32 ones here, and at 4 bits
twice as slowly; the C loop (engine/cpu/native/decode_attention_quantized.c) unpacks each line once
for all the query heads of its KV head, so a step's attention reads a quarter (8 bits) or an eighth
(4 bits) of the float32 bytes. Rows it cannot take (a prefill chunk, other dtypes, the shortcuts
off, Metal and CUDA) go to MLX's quantized matmuls (engine/batch/attention.py).

Guarantee: the same attention as mlx-lm's quantized attention up to float32 rounding (the tests
compare both on the same packed K/V).
"""

from __future__ import annotations

import ctypes

import mlx.core as mx

from engine.batch.attention import AttentionCall, QuantizedCall, fused_attention, quantized_attention
from engine.cpu import native_attention
from engine.cpu.shortcuts import current
from engine.cpu.split_attention import attend


def attend_quantized(
    calls: list[QuantizedCall], scale: float, sinks: mx.array | None
) -> list[mx.array] | None:
    """Each call's attention output in order; None where the step's shortcuts take none of them."""
    lib = native_attention.loaded() if current().native_attention else None
    if lib is None or sinks is not None:
        return None
    taken = [i for i, call in enumerate(calls) if native_attention.fits_quantized(call)]
    if not taken and not any(native_attention.dequantizable(call) for call in calls):
        return None
    mx.eval([(call.queries, call.keys, call.values) for call in calls])
    outputs: list[mx.array] = [mx.array(0)] * len(calls)
    if taken:
        rows = native_attention.attend_quantized_rows(lib, [calls[i] for i in taken], scale)
        parts = mx.split(rows, len(taken), axis=0) if len(taken) > 1 else [rows]
        for i, part in zip(taken, parts, strict=True):
            outputs[i] = part
    taken_set = set(taken)
    rest = [i for i in range(len(calls)) if i not in taken_set]
    chunks = [i for i in rest if native_attention.dequantizable(calls[i])]
    for i, output in zip(
        chunks, _chunks_at_full_precision(lib, [calls[i] for i in chunks], scale), strict=True
    ):
        outputs[i] = output
    others = [i for i in rest if i not in set(chunks)]
    for i, output in zip(others, quantized_attention([calls[i] for i in others], scale, sinks), strict=True):
        outputs[i] = output
    return outputs


def _chunks_at_full_precision(lib: ctypes.CDLL, calls: list[QuantizedCall], scale: float) -> list[mx.array]:
    """Prefill chunks (several query tokens): their rows' K/V unpacked into float32 by the C loop, then
    the float32 path (engine/cpu/split_attention.py, else MLX's fused call). MLX's quantized matmul ran
    a cold 1K prompt's prefill 1.5-2.1x slower than float32 here; unpacking a row costs one pass."""
    if not calls:
        return []
    plain = [
        AttentionCall(
            call.queries,
            native_attention.dequantize_parts(lib, call.keys, call.bits, call.group_size),
            native_attention.dequantize_parts(lib, call.values, call.bits, call.group_size),
            mask=call.mask,
        )
        for call in calls
    ]
    taken = attend(plain, scale, None)
    return fused_attention(plain, scale, None) if taken is None else taken
