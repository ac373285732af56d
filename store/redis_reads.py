"""Reading blocks' values from Redis, checksummed as they arrive: straight into one buffer per block over
our own connections (store/resp.py), or through a client we were handed (fakeredis in tests).

RedisStore's `_fetch_blocks` (the backend's get-many primitive) is these two paths.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from store.backend import Blob
from store.checksum import crc32
from store.iopool import submit
from store.manifest import BlockRef, Manifest, part_sizes
from store.redis_keys import RedisKeys, as_blob, join_parts
from store.resp import get_into


def fetch_into_place(
    pool: Any, keys: RedisKeys, agent_id: str, manifest: Manifest, refs: Sequence[BlockRef]
) -> list[tuple[Blob, int] | None]:
    """Each block's values read straight into one buffer per block (resp.get_into); a block's
    CRC-32 runs on a helper thread as soon as its last value is in, while the next arrive."""
    buffers = [np.empty(ref.nbytes, dtype=np.uint8) for ref in refs]
    requests: list[tuple[bytes, memoryview]] = []
    last_part: dict[int, int] = {}  # request index -> the block it completes
    for block, (ref, buffer) in enumerate(zip(refs, buffers, strict=True)):
        block_keys = keys.parts(agent_id, ref.name, ref.nbytes, manifest.part_bytes)
        view, offset = buffer.data, 0
        for key, size in zip(block_keys, part_sizes(ref.nbytes, manifest.part_bytes), strict=True):
            requests.append((key.encode(), view[offset : offset + size]))
            offset += size
        last_part[len(requests) - 1] = block
    crcs: dict[int, Future[int]] = {}

    def on_read(index: int) -> None:
        block = last_part.get(index)
        if block is not None:
            crcs[block] = submit(crc32, buffers[block])

    results = get_into(pool, requests, on_read=on_read)
    fetched: list[tuple[Blob, int] | None] = []
    start = 0
    for block, ref in enumerate(refs):
        count = len(part_sizes(ref.nbytes, manifest.part_bytes))
        parts, start = results[start : start + count], start + count
        crc = crcs[block].result()
        if any(part is None for part in parts):
            fetched.append(None)
        elif all(part is True for part in parts):
            fetched.append((buffers[block].data, crc))
        else:  # a value of another size: the block as stored, which decoding reports as truncated
            blob = join_parts(buffers[block], ref.nbytes, manifest.part_bytes, parts)
            fetched.append((blob, crc32(blob)))
    return fetched


def fetch_with_client(
    client: Any,
    keys: RedisKeys,
    agent_id: str,
    manifest: Manifest,
    refs: Sequence[BlockRef],
    chunk_bytes: int,
) -> list[tuple[Blob, int] | None]:
    """The same through the client's own pipeline (a client we were handed, e.g. fakeredis)."""
    fetched: list[tuple[Blob, int] | None] = []
    for chunk in _chunks(refs, chunk_bytes):
        pipe = client.pipeline(transaction=False)
        counts = []
        for ref in chunk:
            block_keys = keys.parts(agent_id, ref.name, ref.nbytes, manifest.part_bytes)
            counts.append(len(block_keys))
            for key in block_keys:
                pipe.get(key)
        values = [as_blob(value) for value in pipe.execute()]
        for count in counts:
            parts, values = values[:count], values[count:]
            if any(part is None for part in parts):
                fetched.append(None)
                continue
            blob = parts[0] if count == 1 else b"".join(p for p in parts if p is not None)
            assert blob is not None
            fetched.append((blob, crc32(blob)))
    return fetched


def _chunks(refs: Sequence[BlockRef], max_bytes: int) -> Iterator[Sequence[BlockRef]]:
    start, size = 0, 0
    for index, ref in enumerate(refs):
        size += ref.nbytes
        if size >= max_bytes:
            yield refs[start : index + 1]
            start, size = index + 1, 0
    if start < len(refs):
        yield refs[start:]
