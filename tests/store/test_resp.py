"""The zero-copy RESP packer: same bytes as redis-py's own packer, multi-part values intact."""

from __future__ import annotations

import numpy as np
import pytest
from redis.connection import Encoder, PythonRespSerializer

from store.resp import ScatterPacker, ScatterValue


def _flat(chunks: list[bytes | memoryview]) -> bytes:
    return b"".join(bytes(c) for c in chunks)


@pytest.mark.parametrize(
    "args",
    [
        ("GET", "key"),
        ("SET", "k", b"v" * 100_000, "PX", 3600000),
        ("ZADD", "idx", "XX", 1.5, "agent"),
        ("CONFIG GET", "maxmemory"),
        (b"HSET", b"h", "f", 42),
        ("SET", "k", "é"),
    ],
)
def test_ordinary_commands_pack_like_redis_py(args: tuple[object, ...]) -> None:
    reference = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
    assert _flat(ScatterPacker().pack(*args)) == _flat(reference.pack(*args))


def test_scatter_value_is_one_bulk_string_sent_without_copies() -> None:
    arrays: list[np.ndarray] = [np.arange(10, dtype=np.float32), np.arange(3, dtype=np.uint8)]
    parts: list[bytes | memoryview] = [b"head", arrays[0].data, b"", arrays[1].data]
    value = ScatterValue(parts)
    chunks = ScatterPacker().pack("SET", "k", value)
    joined = b"head" + arrays[0].tobytes() + arrays[1].tobytes()
    assert _flat(chunks) == b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$%d\r\n" % len(joined) + joined + b"\r\n"
    assert any(isinstance(c, memoryview) and c.obj is arrays[0] for c in chunks)  # the array itself


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(TypeError):
        ScatterPacker().pack("SET", "k", True)
    with pytest.raises(TypeError):
        ScatterPacker().pack("SET", "k", object())
