"""KV quantization: MLX's affine quantize/dequantize, the one rule the pool and the store share.

Why here: the running batch keeps K/V quantized (`--kv-bits`) and the store quantizes at rest
(`--store-quantization`); with one rule, an agent's blocks move between the two as they are
when their bits and group size agree (store/quant.py re-exports this module: store may import
engine, not the other way).

A quantized array of shape (..., dim) is three: packed uint32 (..., dim * bits / 32) and
per-group scales and biases (..., dim / group_size) in the cache's own dtype (bfloat16 carried
as uint16 bits on the host, as everywhere in the engine).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

Quantization = Literal["none", "q8", "q4"]
QUANT_BITS: dict[str, int] = {"q8": 8, "q4": 4}
KV_BITS = (8, 4)
GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 64


@dataclass(frozen=True)
class KVQuant:
    """How a pool (or a block) holds K/V quantized: bits per value and values per group."""

    bits: int
    group_size: int = DEFAULT_GROUP_SIZE

    @property
    def name(self) -> str:
        """The store's name for it: q8 / q4."""
        return f"q{self.bits}"

    def packed_dim(self, dim: int) -> int:
        return dim * self.bits // 32

    def groups(self, dim: int) -> int:
        return dim // self.group_size

    def bytes_per_vector(self, dim: int, dtype_bytes: int) -> int:
        """Bytes of one head vector of `dim` values: packed values + a scale and a bias per group."""
        return self.packed_dim(dim) * 4 + 2 * self.groups(dim) * dtype_bytes


def kv_quant(bits: int | None, group_size: int | None, head_dims: tuple[int, ...]) -> KVQuant | None:
    """The pool's quantization for `--kv-bits` / `--kv-group-size` (None: full precision);
    ValueError naming what is wrong otherwise."""
    if bits is None:
        if group_size is not None:
            raise ValueError("kv_group_size is set but kv_bits is not: name 8 or 4 bits too")
        return None
    if bits not in KV_BITS:
        raise ValueError(f"kv_bits must be 8 or 4, not {bits!r}")
    size = DEFAULT_GROUP_SIZE if group_size is None else group_size
    check_quantization(f"q{bits}", size, head_dims)
    return KVQuant(bits, size)


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
