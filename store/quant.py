"""KV quantization at rest with MLX's affine quantize/dequantize.

A block's K (or V) arrays for all layers are stacked into one (layers, heads, tokens,
head_dim) array so one quantize call covers the whole block. Quantized data is packed
uint32 plus per-group scales and biases in the cache's own dtype; `dequantize` gives
back arrays in the spec's storage dtype (bfloat16 as uint16 bits), which is what the
engine rebuilds its caches from. MLX is imported lazily: `none` never needs it.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

Quantization = Literal["none", "q8", "q4"]
QUANT_BITS: dict[str, int] = {"q8": 8, "q4": 4}
GROUP_SIZES = (32, 64, 128)


def check_quantization(quantization: str, group_size: int, head_dims: tuple[int, ...]) -> None:
    """Raise ValueError unless the mode and group size can quantize every head dim."""
    if quantization not in ("none", *QUANT_BITS):
        raise ValueError(f"quantization must be 'none', 'q8' or 'q4', not {quantization!r}")
    if quantization == "none":
        return
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, not {group_size}")
    for dim in head_dims:
        if dim % group_size:
            raise ValueError(f"head dim {dim} is not a multiple of group_size {group_size}")


def quantize(
    stacked: np.ndarray, dtype: str, bits: int, group_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(packed uint32, scales, biases) of a stacked array in storage dtype `dtype`."""
    import mlx.core as mx

    array = mx.array(stacked)
    if dtype == "bfloat16":
        array = array.view(mx.bfloat16)
    packed, scales, biases = mx.quantize(array, group_size=group_size, bits=bits)
    mx.eval(packed, scales, biases)
    return _host(packed), _host(scales), _host(biases)


def dequantize(
    packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, dtype: str, bits: int, group_size: int
) -> np.ndarray:
    """The stacked array back in storage dtype `dtype` (bfloat16 as uint16 bits)."""
    import mlx.core as mx

    def dev(a: np.ndarray) -> mx.array:
        out = mx.array(a)
        return out.view(mx.bfloat16) if dtype == "bfloat16" else out

    out = mx.dequantize(mx.array(packed), dev(scales), dev(biases), group_size=group_size, bits=bits)
    mx.eval(out)
    return _host(out)


def _host(array: object) -> np.ndarray:
    import mlx.core as mx

    assert isinstance(array, mx.array)
    if array.dtype == mx.bfloat16:
        array = array.view(mx.uint16)
    # np.array copies: the result must not keep the MLX buffer alive or alias it.
    return np.array(array)
