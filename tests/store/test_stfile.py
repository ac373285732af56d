"""The hand-written safetensors encoder/decoder against the real safetensors library."""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load as st_load
from safetensors.numpy import load_file, save

from store.stfile import SafetensorsError, encode, parse_header, view


def _blob(tensors: list[tuple[str, str, np.ndarray]], metadata: dict[str, str]) -> bytes:
    header, buffers = encode(tensors, metadata)
    return b"".join([header, *buffers])


def _sample() -> list[tuple[str, str, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [
        ("L0.k", "F32", rng.standard_normal((2, 5, 8), dtype=np.float32)),
        ("L0.v", "F16", rng.standard_normal((2, 5, 8)).astype(np.float16)),
        ("ids", "I64", np.arange(7, dtype=np.int64)),
        ("packed", "U32", rng.integers(0, 2**32, size=(3, 4), dtype=np.uint32)),
        ("empty", "F32", np.zeros((0, 4), dtype=np.float32)),
    ]


def test_blob_opens_with_safetensors_library(tmp_path: Path) -> None:
    tensors = _sample()
    blob = _blob(tensors, {"format": "x", "n": "1"})
    loaded = st_load(blob)
    path = tmp_path / "t.safetensors"
    path.write_bytes(blob)
    from_file = load_file(path)
    for name, _dtype, array in tensors:
        assert np.array_equal(loaded[name], array) and loaded[name].dtype == array.dtype
        assert np.array_equal(from_file[name], array)
    with safe_open(str(path), framework="numpy") as handle:
        assert handle.metadata() == {"format": "x", "n": "1"}
        assert set(handle.keys()) == {name for name, _, _ in tensors}


def test_bfloat16_bits_read_back_as_bfloat16(tmp_path: Path) -> None:
    """numpy has no bfloat16, so safetensors' numpy path cannot materialize it: it must still
    see a BF16 tensor of the right shape, and MLX's safetensors loader must give the values."""
    mx = pytest.importorskip("mlx.core")
    values = np.array([[1.0, -2.5, 3.140625, 0.0]], dtype=np.float32)
    bits = (values.view(np.uint32) >> 16).astype(np.uint16)
    path = tmp_path / "bf16.safetensors"
    path.write_bytes(_blob([("x", "BF16", bits)], {"m": "1"}))
    with safe_open(str(path), framework="numpy") as handle:
        assert handle.get_slice("x").get_dtype() == "BF16"
        assert handle.get_slice("x").get_shape() == [1, 4]
    loaded = mx.load(str(path))["x"]
    assert loaded.dtype == mx.bfloat16
    assert np.array_equal(np.array(loaded.astype(mx.float32)), values)


def test_reader_parses_library_output_and_views_without_copy() -> None:
    arrays: dict[str, np.ndarray] = {
        "a": np.arange(12, dtype=np.float32).reshape(3, 4),
        "b": np.ones(5, dtype=np.uint8),
    }
    blob = bytearray(save(arrays, metadata={"k": "v"}))
    metadata, entries, start = parse_header(blob)
    assert metadata == {"k": "v"}
    a = view(blob, entries["a"], start)
    assert np.array_equal(a, arrays["a"])
    a[0, 0] = 99.0  # a view into the blob, not a copy
    assert view(blob, entries["a"], start)[0, 0] == 99.0


def test_header_is_padded_for_aligned_views() -> None:
    header, _ = encode(_sample(), {"odd": "x" * 3})
    assert len(header) % 8 == 0
    assert struct.unpack_from("<Q", header)[0] == len(header) - 8


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b[:4],  # shorter than the length prefix
        lambda b: struct.pack("<Q", 10**9) + b[8:],  # header length beyond the blob
        lambda b: b[:8] + b"[" + b[9:],  # not a JSON object
        lambda b: b[:-1],  # data truncated
        lambda b: b + b"\0",  # trailing bytes
        lambda b: b.replace(b'"F32"', b'"F99"', 1),  # unknown dtype
        lambda b: b.replace(b"[2,5,8]", b"[2,5,9]", 1),  # shape disagrees with the offsets
    ],
)
def test_malformed_blobs_are_rejected(damage: Callable[[bytes], bytes]) -> None:
    blob = _blob(_sample(), {})
    with pytest.raises(SafetensorsError):
        parse_header(damage(blob))


def test_non_contiguous_input_is_refused() -> None:
    array = np.zeros((4, 4), dtype=np.float32)[:, ::2]
    with pytest.raises(SafetensorsError):
        encode([("x", "F32", array)], {})
