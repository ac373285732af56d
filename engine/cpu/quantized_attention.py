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

import mlx.core as mx

from engine.batch.attention import QuantizedCall, quantized_attention
from engine.cpu import native_attention
from engine.cpu.shortcuts import current


def attend_quantized(
    calls: list[QuantizedCall], scale: float, sinks: mx.array | None
) -> list[mx.array] | None:
    """Each call's attention output in order; None where the step's shortcuts take none of them."""
    lib = native_attention.loaded() if current().native_attention else None
    if lib is None or sinks is not None:
        return None
    taken = [i for i, call in enumerate(calls) if native_attention.fits_quantized(call)]
    if not taken:
        return None
    mx.eval([(calls[i].queries, calls[i].keys, calls[i].values) for i in taken])
    rows = native_attention.attend_quantized_rows(lib, [calls[i] for i in taken], scale)
    outputs: list[mx.array] = [mx.array(0)] * len(calls)
    for i, part in zip(taken, mx.split(rows, len(taken), axis=0) if len(taken) > 1 else [rows], strict=True):
        outputs[i] = part
    taken_set = set(taken)
    rest = [i for i in range(len(calls)) if i not in taken_set]
    for i, output in zip(rest, quantized_attention([calls[i] for i in rest], scale, sinks), strict=True):
        outputs[i] = output
    return outputs
