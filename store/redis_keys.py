"""Where RedisStore keeps things: the key layout and how a block is cut into values (docs/store-format.md).

One place so that the commit, the collector of shared blocks and the readers agree on every name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from redis.exceptions import DataError

from store.agent_ids import agent_key
from store.backend import Blob
from store.manifest import BlockRef, parse_shared_name, part_sizes, shared_name


@dataclass(frozen=True)
class RedisKeys:
    """The keys of one store, all under `prefix`."""

    prefix: str
    index: str = field(init=False)  # sorted set: agent id -> last used
    sizes: str = field(init=False)  # hash: agent id -> bytes of its own
    links: str = field(init=False)  # hash: agent id -> "<name>:<bytes>,..." of the shared blocks it uses
    pinned: str = field(init=False)  # set: pinned agent ids
    prefixes: str = field(init=False)  # sorted set: shared block held for anonymous prefixes -> last used
    prefix_sizes: str = field(init=False)  # hash: such a block -> "<nbytes>:<part_bytes>"
    replication_mark: str = field(init=False)

    def __post_init__(self) -> None:
        for name, suffix in (
            ("index", "index"),
            ("sizes", "sizes"),
            ("links", "links"),
            ("pinned", "pinned"),
            ("prefixes", "prefixes"),
            ("prefix_sizes", "prefix-sizes"),
            ("replication_mark", "replication-mark"),
        ):
            object.__setattr__(self, name, f"{self.prefix}{suffix}")

    def manifest(self, agent_id: str) -> str:
        return f"{self.prefix}{agent_key(agent_id)}:m"

    def block(self, agent_id: str, name: str) -> str:
        return f"{self.prefix}{agent_key(agent_id)}:b:{name}"

    def parts(self, agent_id: str, name: str, nbytes: int, part_bytes: int) -> list[str]:
        """The keys of a block's values: `...:b:<name>` (`<prefix>s:<name>` for a shared block),
        then `:1`, `:2`... appended for the rest."""
        base = f"{self.prefix}s:{name}" if parse_shared_name(name) else self.block(agent_id, name)
        count = len(part_sizes(nbytes, part_bytes))
        return [base, *(f"{base}:{index}" for index in range(1, count))]

    def of_refs(self, agent_id: str, refs: Sequence[BlockRef], part_bytes: int) -> list[str]:
        return [key for ref in refs for key in self.parts(agent_id, ref.name, ref.nbytes, part_bytes)]

    def refs(self, name: str) -> str:
        """Set of the agents whose manifest uses this shared block (its reference count)."""
        return f"{self.prefix}s:{name}:refs"

    def pointer(self, share: str) -> str:
        """`<crc32>:<nbytes>` of a stored version of a share key: how other agents find it."""
        return f"{self.prefix}s:{share}"

    def release(self, ref: BlockRef, part_bytes: int) -> tuple[list[str], str]:
        """The KEYS of the release of a shared block (its reference set, its share key's pointer, its
        values) and the pointer value that names this version."""
        keys = [
            self.refs(ref.name),
            self.pointer(share_of(ref.name)),
            *self.parts("", ref.name, ref.nbytes, part_bytes),
        ]
        return keys, pointer_value(ref.crc32, ref.nbytes)


def share_of(name: str) -> str:
    """The share key of a shared block's name `{share}.{crc32:08x}`."""
    return name.partition(".")[0]


def pointer_value(crc: int, nbytes: int) -> str:
    return f"{crc:08x}:{nbytes}"


def parse_pointer(share: str, value: object) -> tuple[str, int, int] | None:
    """(name, nbytes, crc32) of the version a pointer names; None if there is none (or not ours)."""
    try:
        crc_hex, nbytes = bytes(value).decode().split(":")  # type: ignore[call-overload]
        return shared_name(share, int(crc_hex, 16)), int(nbytes), int(crc_hex, 16)
    except (TypeError, ValueError):
        return None


def links_value(links: Sequence[tuple[str, int]]) -> str:
    """A `links` entry for these (name, bytes) shared blocks (parse_links reads it back)."""
    return ",".join(f"{name}:{nbytes}" for name, nbytes in links)


def parse_links(value: bytes | str | None) -> tuple[tuple[str, int], ...]:
    """A `links` entry: the (name, bytes) of the shared blocks an agent uses (none for a store
    written before links were kept, whose `sizes` then counted them as its own)."""
    if not value:
        return ()
    text = value.decode() if isinstance(value, bytes) else value
    pairs = (item.rpartition(":") for item in text.split(","))
    return tuple((name, int(nbytes)) for name, _, nbytes in pairs)


def split_parts(parts: Sequence[bytes | memoryview], part_bytes: int) -> list[list[memoryview]]:
    """A blob given as buffers, cut into consecutive values of at most `part_bytes` (views, no copy)."""
    views = [memoryview(part).cast("B") for part in parts if len(part)]
    if part_bytes <= 0:
        return [views]
    values: list[list[memoryview]] = [[]]
    room = part_bytes
    for view in views:
        while len(view):
            if room == 0:
                values.append([])
                room = part_bytes
            piece, view = view[:room], view[room:]
            values[-1].append(piece)
            room -= len(piece)
    return values


def join_parts(
    buffer: np.ndarray, nbytes: int, part_bytes: int, parts: Sequence[bool | bytes | None]
) -> bytes:
    """A block whose values did not all have their recorded sizes, joined as stored."""
    pieces: list[bytes] = []
    offset = 0
    for size, part in zip(part_sizes(nbytes, part_bytes), parts, strict=True):
        pieces.append(buffer[offset : offset + size].tobytes() if part is True else bytes(part or b""))
        offset += size
    return b"".join(pieces)


def as_blob(value: object) -> Blob | None:
    """A GET reply as a blob (the client never decodes replies, so it is bytes or None)."""
    if value is None or isinstance(value, bytes | bytearray | memoryview):
        return value
    raise DataError(f"Redis returned a {type(value).__name__}, not bytes")
