"""The C loop for decoding rows over quantized K/V (engine/cpu/quantized_attention.py) against MLX."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import pytest

from engine.batch.attention import QuantizedCall, quantized_attention
from engine.cpu import native_attention
from engine.cpu.quantized_attention import attend_quantized
from engine.cpu.shortcuts import CpuShortcuts, in_ragged_step

ON = CpuShortcuts(numpy_exp=True, pad_rows=True, native_attention=True)


def _call(
    length: int, bits: int, group_size: int, heads: int = 6, kv_heads: int = 2, dim: int = 64
) -> QuantizedCall:
    capacity = -(-length // 256) * 256
    keys = mx.quantize(mx.random.normal((1, kv_heads, capacity, dim)), group_size=group_size, bits=bits)
    values = mx.quantize(mx.random.normal((1, kv_heads, capacity, dim)), group_size=group_size, bits=bits)
    k, v = (
        (packed[..., :length, :], scales[..., :length, :], biases[..., :length, :])
        for packed, scales, biases in (keys, values)
    )
    return QuantizedCall(mx.random.normal((1, heads, 1, dim)), k, v, bits, group_size)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group_size", [32, 64])
def test_the_c_loop_equals_mlx_quantized_attention(bits: int, group_size: int) -> None:
    if native_attention.library() is None:
        pytest.skip("no C compiler here")
    mx.random.seed(bits + group_size)
    calls = [_call(length, bits, group_size) for length in (1, 7, 300, 1100)]
    # mlx-lm's function scales its queries in place: give it copies
    expected = quantized_attention([replace(c, queries=c.queries + 0) for c in calls], 0.125, None)
    with in_ragged_step(ON):
        got = attend_quantized(calls, 0.125, None)
    assert got is not None
    for a, b in zip(expected, got, strict=True):
        assert a.shape == b.shape
        assert float(mx.abs(a - b).max()) < 1e-5


def test_prefill_chunks_are_unpacked_and_attend_at_full_precision() -> None:
    if native_attention.library() is None:
        pytest.skip("no C compiler here")
    lib = native_attention.library()
    assert lib is not None
    decoding = _call(40, 8, 32)
    chunk = replace(_call(300, 4, 32), queries=mx.random.normal((1, 6, 17, 64)), mask="causal")
    assert native_attention.fits_quantized(decoding) and not native_attention.fits_quantized(chunk)
    assert native_attention.dequantizable(chunk)
    mx.eval(chunk.keys)
    unpacked = native_attention.dequantize_parts(lib, chunk.keys, 4, 32)
    assert mx.array_equal(unpacked, mx.dequantize(*chunk.keys, group_size=32, bits=4))
    expected = quantized_attention(
        [replace(c, queries=c.queries + 0) for c in (decoding, chunk)], 0.125, None
    )
    with in_ragged_step(ON):
        got = attend_quantized([decoding, chunk], 0.125, None)
    assert got is not None and got[1].shape == (1, 6, 17, 64)
    for a, b in zip(expected, got, strict=True):
        assert float(mx.abs(a - b).max()) < 1e-5


def test_with_the_shortcuts_off_nothing_is_taken() -> None:
    with in_ragged_step(replace(ON, native_attention=False)):
        assert attend_quantized([_call(10, 4, 32)], 0.125, None) is None
