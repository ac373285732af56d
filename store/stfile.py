"""A minimal safetensors writer and reader that never concatenates tensor data.

The format (https://github.com/huggingface/safetensors) is: 8-byte little-endian
header length N, N bytes of JSON header, then the raw tensor bytes back to back.
Writing it ourselves lets the store hand the header plus each numpy array's own
buffer to `os.writev` or a Redis socket (no copy of the KV bytes), and read back with
`np.frombuffer` views into one buffer (no copy either). Files written here open with
the plain `safetensors` library; the tests check that.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

# safetensors dtype name <-> numpy dtype. BF16 has no numpy dtype: its bits travel as uint16.
ST_DTYPES: dict[str, np.dtype] = {
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(np.uint16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8),
}
MAX_HEADER_BYTES = 16 * 1024 * 1024
_ALIGN = 8  # pad the header so every tensor view starts 8-byte aligned


class SafetensorsError(ValueError):
    """The bytes are not a well-formed safetensors blob (or not the one expected)."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]
    start: int  # offsets relative to the start of the data section
    end: int


def encode(
    tensors: Sequence[tuple[str, str, np.ndarray]], metadata: Mapping[str, str]
) -> tuple[bytes, list[memoryview]]:
    """Header bytes and the data buffers (views of the arrays) of one safetensors blob.

    `tensors` holds (name, safetensors dtype, C-contiguous array) in file order. The
    blob is the header followed by the buffers, in that order.
    """
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    buffers: list[memoryview] = []
    offset = 0
    for name, dtype, array in tensors:
        if not array.flags.c_contiguous:
            raise SafetensorsError(f"tensor {name} is not C-contiguous")
        if ST_DTYPES[dtype].itemsize != array.dtype.itemsize:
            raise SafetensorsError(f"tensor {name}: {array.dtype} cannot be stored as {dtype}")
        nbytes = array.nbytes
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
        if nbytes:
            buffers.append(array.data.cast("B"))
    text = json.dumps(header, separators=(",", ":")).encode()
    pad = (-(8 + len(text))) % _ALIGN
    text += b" " * pad
    return struct.pack("<Q", len(text)) + text, buffers


def parse_header(blob: bytes | bytearray | memoryview) -> tuple[dict[str, str], dict[str, TensorEntry], int]:
    """(metadata, tensors by name, data start) of a safetensors blob, checked for consistency.

    Checks what a corrupted or truncated blob would break: the header length, the JSON,
    each tensor's dtype, shape and offsets, and that the data section is exactly covered.
    """
    view = memoryview(blob)
    if len(view) < 8:
        raise SafetensorsError(f"blob of {len(view)} bytes is too short for a safetensors header")
    (header_len,) = struct.unpack_from("<Q", view, 0)
    if header_len > MAX_HEADER_BYTES or 8 + header_len > len(view):
        raise SafetensorsError(f"header length {header_len} does not fit a blob of {len(view)} bytes")
    try:
        header = json.loads(bytes(view[8 : 8 + header_len]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SafetensorsError(f"header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise SafetensorsError("header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise SafetensorsError("__metadata__ must map strings to strings")
    data_start = 8 + header_len
    data_len = len(view) - data_start
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        entries[name] = _entry(name, info, data_len)
    spans = sorted((e.start, e.end) for e in entries.values())
    position = 0
    for start, end in spans:
        if start != position:
            raise SafetensorsError("tensor data has a gap or an overlap")
        position = end
    if position != data_len:
        raise SafetensorsError(f"tensors cover {position} of {data_len} data bytes")
    return metadata, entries, data_start


def _entry(name: str, info: object, data_len: int) -> TensorEntry:
    if not isinstance(info, dict):
        raise SafetensorsError(f"tensor {name}: entry is not an object")
    dtype = info.get("dtype")
    shape = info.get("shape")
    offsets = info.get("data_offsets")
    if dtype not in ST_DTYPES:
        raise SafetensorsError(f"tensor {name}: unsupported dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise SafetensorsError(f"tensor {name}: bad shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= data_len
    ):
        raise SafetensorsError(f"tensor {name}: bad data_offsets {offsets!r}")
    expected = int(np.prod(shape, dtype=np.int64)) * ST_DTYPES[dtype].itemsize
    if offsets[1] - offsets[0] != expected:
        raise SafetensorsError(f"tensor {name}: {offsets[1] - offsets[0]} bytes for shape {shape} {dtype}")
    return TensorEntry(name, dtype, tuple(shape), offsets[0], offsets[1])


def view(blob: bytes | bytearray | memoryview, entry: TensorEntry, data_start: int) -> np.ndarray:
    """Zero-copy numpy view of one tensor (read-only when the blob is bytes)."""
    count = (entry.end - entry.start) // ST_DTYPES[entry.dtype].itemsize
    flat = np.frombuffer(blob, dtype=ST_DTYPES[entry.dtype], count=count, offset=data_start + entry.start)
    return flat.reshape(entry.shape)
