"""RESP on the store's hot paths: values sent from their own buffers, replies read straight into place.

Sending: redis-py (with hiredis) copies every value into one packed command. A block is a
safetensors header plus one buffer per layer tensor; joining them first and packing
them again would copy every KV byte twice before the socket. `ScatterValue` carries
the parts and `ScatterPacker` emits them as separate chunks of one bulk string, which
redis-py's connection sends as they are (`sendall` per chunk). It plugs in through
the connection's documented `command_packer` argument.

Receiving: redis-py's hiredis reader copies each reply three times (socket buffer, the
reader's own buffer, a new bytes object). `get_into` pipelines GETs on one of the pool's
connections and reads each bulk reply with `recv_into` straight into the caller's buffer,
at its final place: the parts of a block land back to back in one allocation, with no
copy after the kernel's. Anything unexpected (an error reply, a timeout) disconnects the
connection, so it is never reused out of step with the server.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse, ResponseError

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


_LINE_BUFFER = 64 * 1024
GET_WINDOW_BYTES = 32 * 1024 * 1024  # reply bytes requested ahead of what has been read


def _get_command(key: bytes) -> bytes:
    return b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(key), key)


class _ReplyReader:
    """RESP2 replies from a socket: header lines through a small buffer, payloads into the caller's."""

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self._buffer = bytearray(_LINE_BUFFER)
        self._view = memoryview(self._buffer)
        self._start = 0
        self._end = 0

    def _fill(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buffer):
            if self._start == 0:
                raise InvalidResponse("a RESP header line longer than 64 KiB")
            kept = self._end - self._start
            self._buffer[:kept] = self._buffer[self._start : self._end]
            self._start, self._end = 0, kept
        received = self._sock.recv_into(self._view[self._end :])
        if not received:
            raise RedisConnectionError("Redis closed the connection")
        self._end += received

    def line(self) -> bytes:
        while True:
            newline = self._buffer.find(b"\r\n", self._start, self._end)
            if newline >= 0:
                line = bytes(self._view[self._start : newline])
                self._start = newline + 2
                return line
            self._fill()

    def payload_into(self, target: memoryview) -> None:
        """Exactly len(target) bytes, then the CRLF that ends a bulk string."""
        buffered = min(len(target), self._end - self._start)
        target[:buffered] = self._view[self._start : self._start + buffered]
        self._start += buffered
        done = buffered
        while done < len(target):
            received = self._sock.recv_into(target[done:])
            if not received:
                raise RedisConnectionError("Redis closed the connection")
            done += received
        while self._end - self._start < 2:
            self._fill()
        if self._view[self._start : self._start + 2] != b"\r\n":
            raise InvalidResponse("a bulk string does not end with CRLF")
        self._start += 2

    def bulk_size(self) -> int:
        """The length of the next bulk string reply, -1 for nil; raises for any other reply."""
        line = self.line()
        if line.startswith(b"$"):
            return int(line[1:])
        if line == b"_":  # RESP3's null (redis-py negotiates RESP3 where the server speaks it)
            return -1
        if line.startswith(b"-"):
            raise ResponseError(line[1:].decode(errors="replace"))
        raise InvalidResponse(f"expected a bulk string, got {line[:40]!r}")


def get_into(
    pool: Any,
    requests: Sequence[tuple[bytes, memoryview]],
    *,
    on_read: Callable[[int], None] | None = None,
    window_bytes: int = GET_WINDOW_BYTES,
) -> list[bool | bytes | None]:
    """GET each key into its buffer, pipelined on one connection of redis-py's `pool`.

    Per request: True when the value had the buffer's size and now fills it, None when the
    key does not exist, or the value itself (bytes) when it has another size. `on_read(i)` is
    called as soon as request i is complete. GETs are sent ahead of the replies read, up to
    `window_bytes` of expected values, so the server never buffers a whole cache for us.
    """
    connection = pool.get_connection()
    try:
        results = _pipelined_gets(connection, requests, on_read, window_bytes)
    except BaseException:
        connection.disconnect()  # out of step with the server: never reuse it
        raise
    finally:
        pool.release(connection)
    return results


def _pipelined_gets(
    connection: Any,
    requests: Sequence[tuple[bytes, memoryview]],
    on_read: Callable[[int], None] | None,
    window_bytes: int,
) -> list[bool | bytes | None]:
    results: list[bool | bytes | None] = []
    reader: _ReplyReader | None = None
    sent = 0
    ahead = 0  # bytes of values requested and not yet read
    for index, (_key, target) in enumerate(requests):
        batch = []
        while sent < len(requests) and (sent == index or ahead < window_bytes):
            batch.append(_get_command(requests[sent][0]))
            ahead += len(requests[sent][1])
            sent += 1
        if batch:
            connection.send_packed_command([b"".join(batch)], check_health=False)
        if reader is None:
            reader = _ReplyReader(connection._sock)  # connected by the first send
        size = reader.bulk_size()
        if size < 0:
            results.append(None)
        elif size == len(target):
            reader.payload_into(target)
            results.append(True)
        else:
            other = bytearray(size)
            reader.payload_into(memoryview(other))
            results.append(bytes(other))
        ahead -= len(target)
        if on_read is not None:
            on_read(index)
    return results
