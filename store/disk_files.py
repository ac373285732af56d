"""The disk store's file operations: whole-file reads, vectored writes, atomic replaces and durable
directories (fsync of the file, then of its directory), shared by the agents' area (store/disk.py) and
the shared one (store/disk_shared.py)."""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
from collections.abc import Sequence
from pathlib import Path

from store.backend import Blob
from store.checksum import crc32
from store.iopool import map_parallel

SUFFIX = ".safetensors"
IOV_MAX = 512  # pieces per writev call (the OS limit is 1024 on Linux)


def is_version(name: str) -> bool:
    """A file of the shared index: `<crc32 as 8 hex digits>.safetensors`."""
    stem = name.removesuffix(SUFFIX)
    return name.endswith(SUFFIX) and len(stem) == 8 and all(c in "0123456789abcdef" for c in stem)


def set_mtime(path: Path, when: float) -> bool:
    """Record `when` as the file's last use (its mtime); False if it is gone."""
    stamp = int(when * 1e9)
    try:
        os.utime(path, ns=(stamp, stamp))
    except FileNotFoundError:
        return False
    return True


def read_all(paths: Sequence[Path]) -> list[tuple[Blob, int] | None]:
    """Read and checksum files on the helper threads: one file's CRC overlaps the next read."""

    def fetch(path: Path) -> tuple[Blob, int] | None:
        try:
            blob = read_file(path)
        except FileNotFoundError:
            return None
        return blob, crc32(blob)

    return map_parallel(fetch, paths)


def subdirs(path: Path) -> list[os.DirEntry[str]]:
    try:
        return [entry for entry in os.scandir(path) if entry.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []


def tree_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(root, name)).st_size
    return total


def read_file(path: Path) -> bytes:
    """The whole file as one bytes object (numpy views of it are zero-copy, read-only, aligned).

    bytes, not a bytearray: a bytearray is zero-filled first, an extra pass over memory.
    """
    with open(path, "rb", buffering=0) as f:
        return f.read()


def read_if_present(path: Path) -> bytes | None:
    try:
        return read_file(path)
    except FileNotFoundError:
        return None


def make_dirs(path: Path, *, fsync: bool) -> None:
    """`mkdir -p` that also makes each new directory's entry durable (an fsync of its parent),
    so a block renamed into a new directory cannot vanish with it after a power loss."""
    if path.is_dir():
        return
    make_dirs(path.parent, fsync=fsync)
    try:
        path.mkdir()
    except FileExistsError:
        return
    if fsync:
        fsync_dir(path.parent)


def write_all(fd: int, parts: Sequence[bytes | memoryview]) -> None:
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        batch = views[:IOV_MAX]
        written = os.writev(fd, batch)
        # Drop what was written; a short write leaves the rest of a piece for the next call.
        while batch and written >= len(batch[0]):
            written -= len(batch[0])
            batch.pop(0)
            views.pop(0)
        if written:
            views[0] = views[0][written:]


_temp_counter = itertools.count()


def temp_name() -> str:
    """Unique among live writers: an agent's files are only written under its lock, and the
    process and thread ids tell apart the writers of the store root's own files."""
    return f".tmp-{os.getpid()}-{threading.get_ident()}-{next(_temp_counter)}"


def write_atomic(path: Path, parts: Sequence[bytes | memoryview], *, fsync: bool) -> None:
    tmp = path.with_name(temp_name())
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        write_all(fd, parts)
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)
    if fsync:
        fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
