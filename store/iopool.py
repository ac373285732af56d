"""A small shared thread pool for the store's helper work: CRC-32s and fsyncs that overlap I/O.

The CRC-32 (store/checksum.py) releases the GIL on a large buffer, and so do file reads, writes
and socket sends: a block's CRC can run on a helper thread while the next block is
read or written, instead of adding a second pass over every byte.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from store.checksum import crc32

T = TypeVar("T")
R = TypeVar("R")

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def pool() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            # CRCs use the cores (they drop the GIL); fdatasyncs mostly wait on the disk.
            workers = max(4, min(8, 2 * (os.cpu_count() or 2)))
            _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvrq-store-io")
        return _pool


def crc32_parts(parts: Iterable[bytes | bytearray | memoryview]) -> int:
    crc = 0
    for part in parts:
        crc = crc32(part, crc)
    return crc


def submit(fn: Callable[..., R], *args: object) -> Future[R]:
    """Run fn on the pool; inline (an already finished future) during interpreter shutdown."""
    try:
        return pool().submit(fn, *args)
    except RuntimeError:
        done: Future[R] = Future()
        try:
            done.set_result(fn(*args))
        except Exception as exc:
            done.set_exception(exc)
        return done


def crc32_async(parts: Sequence[bytes | bytearray | memoryview]) -> Future[int]:
    return submit(crc32_parts, parts)


def map_parallel(fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """fn over items on the pool (in order); inline for one item or during interpreter shutdown."""
    if len(items) > 1:
        try:
            results = pool().map(fn, items)  # submits everything now
        except RuntimeError:
            pass
        else:
            return list(results)
    return [fn(item) for item in items]
