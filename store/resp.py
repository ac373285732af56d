"""A RESP command packer for redis-py that sends multi-part values without joining them.

redis-py (with hiredis) copies every value into one packed command. A block is a
safetensors header plus one buffer per layer tensor; joining them first and packing
them again would copy every KV byte twice before the socket. `ScatterValue` carries
the parts and `ScatterPacker` emits them as separate chunks of one bulk string, which
redis-py's connection sends as they are (`sendall` per chunk). It plugs in through
the connection's documented `command_packer` argument.
"""

from __future__ import annotations

from collections.abc import Sequence

_INLINE_LIMIT = 16 * 1024  # larger arguments go out as their own chunk instead of being copied


class ScatterValue:
    """One Redis bulk string made of several buffers, sent back to back."""

    __slots__ = ("nbytes", "parts")

    def __init__(self, parts: Sequence[bytes | memoryview]) -> None:
        self.parts = [memoryview(p).cast("B") for p in parts if len(p)]
        self.nbytes = sum(len(p) for p in self.parts)


def _encode(arg: object) -> bytes | memoryview:
    if isinstance(arg, bytes | memoryview):
        return arg
    if isinstance(arg, bytearray):
        return memoryview(arg)
    if isinstance(arg, bool):
        raise TypeError("a bool is not a Redis argument: convert it to bytes, str, int or float")
    if isinstance(arg, int | float):
        return repr(arg).encode()
    if isinstance(arg, str):
        return arg.encode()
    raise TypeError(f"cannot send a {type(arg).__name__} to Redis")


class ScatterPacker:
    """Packs commands into RESP chunks; ScatterValue arguments are never copied."""

    def pack(self, *args: object) -> list[bytes | memoryview]:
        first = args[0]
        if isinstance(first, str):
            args = (*first.encode().split(), *args[1:])
        elif isinstance(first, bytes) and b" " in first:
            args = (*first.split(), *args[1:])
        chunks: list[bytes | memoryview] = []
        head: list[bytes] = [b"*%d\r\n" % len(args)]
        for arg in args:
            if isinstance(arg, ScatterValue):
                head.append(b"$%d\r\n" % arg.nbytes)
                chunks.append(b"".join(head))
                chunks.extend(arg.parts)
                head = [b"\r\n"]
                continue
            data = _encode(arg)
            if len(data) > _INLINE_LIMIT or isinstance(data, memoryview):
                head.append(b"$%d\r\n" % len(data))
                chunks.append(b"".join(head))
                chunks.append(data)
                head = [b"\r\n"]
            else:
                head.extend((b"$%d\r\n" % len(data), data, b"\r\n"))
        chunks.append(b"".join(head))
        return chunks
