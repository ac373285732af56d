"""DiskStore: agent caches as safetensors files in a directory tree (the default backend).

Layout under the root (docs/store-format.md):

    kvrq-store.json                      marks the directory as a kvrq store
    locks/<key>.lock                     one writer at a time per agent (flock)
    agents/<key[:2]>/<key>/manifest.safetensors
    agents/<key[:2]>/<key>/blocks/<chain>.<generation>.safetensors
    agents/<key[:2]>/<key>/pinned        present while the agent is pinned (no budget, no TTL)
    shared/<share[:2]>/<share>/<crc32>.safetensors      the index of shared (full) blocks
    prefixes/<name[:2]>/<name>.safetensors  a shared block held for anonymous prefixes (a hard link;
                                         its mtime is its last use)

`<key>` is a hash of the agent id, so no id can name a path. Every file is written
to a temporary name, fsynced, then renamed; the manifest goes last, so readers see
the previous complete cache or the new one. Writers of one agent take its lock, so
two processes putting the same agent serialize (last writer wins) and the
garbage collection of unreferenced blocks never races a writer. Readers take no lock.
"""

from __future__ import annotations

import builtins
import contextlib
import fcntl
import itertools
import json
import os
import shutil
import threading
import time
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

from engine.core.spec import ModelCacheSpec
from store.agent_ids import agent_key
from store.backend import BackendOptions, Blob
from store.base import log
from store.block_codec import EncodedBlock
from store.budget import Usage, split_shared
from store.checksum import crc32
from store.commit import NewBlock, WritePlan, WritingBackend
from store.errors import BadCacheError, StoreError
from store.iopool import map_parallel, submit
from store.manifest import (
    BlockRef,
    Manifest,
    parse_shared_name,
    shared_name,
    summarize_manifest,
)
from store.prefix_holds import HoldAttempt, PrefixEntry

MARKER = "kvrq-store.json"
if TYPE_CHECKING:
    from typing_extensions import Unpack

_MARKER_CONTENT = {"format": "kvrq-store", "layout": 1}
MANIFEST = "manifest.safetensors"
PIN = "pinned"
_SUFFIX = ".safetensors"
_IOV_MAX = 512  # pieces per writev call (the OS limit is 1024 on Linux)
_STALE_TEMP_S = 3600.0  # a prefix writer's temp file this old was left by a crash


class DiskStore(WritingBackend):
    kind = "disk"

    def __init__(
        self,
        path: str | os.PathLike[str],
        spec: ModelCacheSpec,
        *,
        ttl_s: float | None = None,
        fsync: bool = True,
        **options: Unpack[BackendOptions],
    ) -> None:
        super().__init__(spec, ttl_s=ttl_s, **options)
        self.root = Path(path).expanduser().resolve()
        self.fsync = fsync
        self._agents = self.root / "agents"
        self._locks = self.root / "locks"
        self._shared = self.root / "shared"
        self._prefixes = self.root / "prefixes"
        self._open_root()

    def _open_root(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        marker = self.root / MARKER
        if marker.exists():
            try:
                content = json.loads(marker.read_text())
            except (OSError, ValueError) as exc:
                raise StoreError(f"{marker} is unreadable: {exc}") from None
            if content != _MARKER_CONTENT:
                raise StoreError(f"{self.root} holds a store of another layout: {content}")
        else:
            if any(not _ours(p.name) for p in self.root.iterdir()):
                raise StoreError(f"{self.root} is not empty and not a kvrq store: refusing to use it")
            _write_atomic(marker, [json.dumps(_MARKER_CONTENT).encode()], fsync=self.fsync)
        self._agents.mkdir(exist_ok=True)
        self._locks.mkdir(exist_ok=True)
        self._shared.mkdir(exist_ok=True)
        self._prefixes.mkdir(exist_ok=True)

    # --- paths ---------------------------------------------------------------------------------
    def _dir(self, key: str) -> Path:
        return self._agents / key[:2] / key

    def _agent_dir(self, agent_id: str) -> Path:
        return self._dir(agent_key(agent_id))

    def _shared_path(self, name: str) -> Path | None:
        """Where the shared index keeps a shared block's version (None for an agent's own block)."""
        parsed = parse_shared_name(name)
        if parsed is None:
            return None
        share, crc = parsed
        return self._shared / share[:2] / share / f"{crc:08x}{_SUFFIX}"

    @contextlib.contextmanager
    def _locked(self, key: str) -> Iterator[None]:
        fd = os.open(self._locks / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the lock

    # --- raw reads -----------------------------------------------------------------------------
    def _read_manifest(self, agent_id: str) -> Blob | None:
        record = self._record(agent_key(agent_id))
        return None if record is None else record[0]

    def _record(self, key: str) -> tuple[bytes, float] | None:
        """The manifest under `key` and its last use (its mtime); None if absent. The TTL is checked
        wherever a manifest is read: an expired one is removed here."""
        path = self._dir(key) / MANIFEST
        try:
            last_used = path.stat().st_mtime
            if self._expired(key, last_used):
                self._expire(key)
                return None
            return _read_file(path), last_used
        except FileNotFoundError:
            return None

    def _expired(self, key: str, last_used: float) -> bool:
        if self.ttl_s is None or time.time() - last_used <= self.ttl_s:
            return False
        return not self._pinned(key)

    def _pinned(self, key: str) -> bool:
        return (self._dir(key) / PIN).exists()

    def _expire(self, key: str) -> None:
        """Remove an agent unused for longer than ttl_s (re-checked under its lock)."""
        with self._locked(key):
            try:
                if not self._expired(key, (self._dir(key) / MANIFEST).stat().st_mtime):
                    return
            except FileNotFoundError:
                return
            self._remove_locked(key)
        self._stats.add("expired")

    def _fetch_blocks(
        self, agent_id: str | None, manifest: Manifest, refs: Sequence[BlockRef]
    ) -> list[tuple[Blob, int] | None]:
        """From the agent's directory (its shared blocks are hard links there), or the shared index."""
        if agent_id is None:
            paths = [self._shared_path(ref.name) for ref in refs]
            return _read_all([path for path in paths if path is not None])
        blocks = self._agent_dir(agent_id) / "blocks"
        return _read_all([blocks / f"{ref.name}{_SUFFIX}" for ref in refs])

    def _find_versions(self, shares: Sequence[str]) -> Iterator[tuple[str, int, int] | None]:
        return (self._version(share) for share in shares)  # lazy: a run's lookups end at its first miss

    def _version(self, share: str) -> tuple[str, int, int] | None:
        """(name, nbytes, crc32) of a stored version of the share key; None if there is none."""
        directory = self._shared / share[:2] / share
        try:
            versions = sorted(name for name in os.listdir(directory) if _is_version(name))
            size = (directory / versions[0]).stat().st_size if versions else 0
        except FileNotFoundError:
            return None  # never stored, or collected a moment ago
        if not versions:
            return None
        crc = int(versions[0].removesuffix(_SUFFIX), 16)
        return shared_name(share, crc), size, crc

    def _touch(self, agent_id: str, manifest: Manifest) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.utime(self._agent_dir(agent_id) / MANIFEST)

    # --- writes --------------------------------------------------------------------------------
    # The put (WritingBackend._commit_put) under the agent's lock: the swap never fails, and the order
    # blocks (fsynced, renamed), then the manifest (renamed last), then garbage is what survives a crash.
    @contextlib.contextmanager
    def _manifest_guard(self, handle: str) -> Iterator[tuple[None, Blob | None]]:
        """The agent's lock (by its key), and its manifest read under it."""
        with self._locked(handle):
            yield None, _read_if_present(self._dir(handle) / MANIFEST)

    def _blocks_exist(self, guard: None, agent_id: str, refs: Sequence[BlockRef]) -> bool:
        """Every block file is there with its size (under the lock no writer removes one)."""
        blocks_dir = self._agent_dir(agent_id) / "blocks"
        for ref in refs:
            try:
                if (blocks_dir / f"{ref.name}{_SUFFIX}").stat().st_size != ref.nbytes:
                    return False
            except FileNotFoundError:
                return False
        return True

    def _swap_manifest(
        self,
        guard: None,
        agent_id: str,
        plan: WritePlan,
        manifest: Manifest,
        manifest_blob: bytes,
        current: Blob | None,
    ) -> list[tuple[BlockRef, int]]:
        """Rename the manifest into place, then collect what it no longer references (shared blocks
        included: under the lock, nothing is left to collect after)."""
        directory = self._agent_dir(agent_id)
        _write_atomic(directory / MANIFEST, [manifest_blob], fsync=self.fsync)
        self._collect_garbage(directory, directory / "blocks", manifest)
        return []

    def _write_blocks(self, agent_id: str, plan: WritePlan) -> list[NewBlock]:
        """Link the shared blocks some agent already stored, write the rest; returns those linked.

        Written blocks go to a temp file each and are synced (each block's fdatasync starts on a
        helper thread as soon as it is written, so the disk flushes one block while the next is
        written), then renamed into place; new shared blocks are then published to the index.
        """
        blocks_dir, blocks = self._agent_dir(agent_id) / "blocks", plan.new_blocks
        _make_dirs(blocks_dir, fsync=self.fsync)  # the manifest's directory too
        linked = [block for block in blocks if self._link_shared(blocks_dir, block)]
        linked_ids = {id(block) for block in linked}
        to_write = [block for block in blocks if id(block) not in linked_ids]
        pending: list[tuple[int, Path, Path]] = []
        syncs: list[Future[None]] = []
        try:
            for block in to_write:
                tmp = blocks_dir / _temp_name()
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                pending.append((fd, tmp, blocks_dir / f"{block.name}{_SUFFIX}"))
                _write_all(fd, block.encoded.parts())
                if self.fsync:
                    syncs.append(submit(os.fdatasync, fd))
            for sync in syncs:
                sync.result()
            for fd, tmp, final in pending:
                os.close(fd)
                os.replace(tmp, final)
            pending = []
            if self.fsync and blocks:
                _fsync_dir(blocks_dir)  # the renames and links: the manifest may now name them
        finally:
            for sync in syncs:
                with contextlib.suppress(OSError):
                    sync.result()  # never close a descriptor a helper thread still uses
            for fd, tmp, _final in pending:
                with contextlib.suppress(OSError):
                    os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
        for block in to_write:
            if block.share is not None:
                self._publish(blocks_dir, block)
        return linked

    def _link_shared(self, blocks_dir: Path, block: NewBlock) -> bool:
        """Hard-link the stored version of a shared block with these exact bytes into the agent's
        directory (the link count is the reference count); False when there is none to link."""
        source = self._shared_path(block.name) if block.share is not None else None
        if source is None:
            return False
        tmp = blocks_dir / _temp_name()
        try:
            os.link(source, tmp)
        except FileNotFoundError:
            return False  # not stored yet, or collected a moment ago
        except OSError as exc:
            log.debug("disk: cannot hard-link shared blocks here (%r): writing them per agent", exc)
            return False
        if tmp.stat().st_size != block.encoded.nbytes:
            os.unlink(tmp)
            return False
        os.replace(tmp, blocks_dir / f"{block.name}{_SUFFIX}")
        return True

    def _publish(self, blocks_dir: Path, block: NewBlock) -> None:
        """Offer a new shared block to other agents: a hard link in the shared index. Best effort and
        not fsynced: losing the link (a crash, a concurrent collection) only loses the saving."""
        target = self._shared_path(block.name)
        if target is None:
            return
        for _attempt in range(3):
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                os.link(blocks_dir / f"{block.name}{_SUFFIX}", target)
                return
            except FileExistsError:
                return  # another agent stored the same bytes first
            except FileNotFoundError:
                continue  # its directory was collected between mkdir and link: again
            except OSError as exc:
                log.debug("disk: could not publish shared block %s: %r", block.name, exc)
                return

    def _release_shared(self, names: Iterable[str]) -> None:
        """Collect the shared versions of these blocks that no agent links any more (link count 1).

        A writer linking one at the same moment keeps its own link, so the race can only lose
        the index entry (a saving), never a block an agent uses.
        """
        for name in names:
            path = self._shared_path(name)
            if path is None:
                continue
            try:
                if os.stat(path).st_nlink > 1:
                    continue
                os.unlink(path)
            except FileNotFoundError:
                continue
            self._stats.add("shared_collected")
            with contextlib.suppress(OSError):
                os.rmdir(path.parent)  # fails while another version is there

    def collect_shared_garbage(self) -> int:
        """Collect every shared version no agent links (left by writers that crashed after
        publishing). Scans the whole index: for maintenance, not for every put. Returns how many
        were removed."""
        before = self._stats.snapshot().get("shared_collected", 0)
        for shard in _scandir(self._shared):
            for share in _scandir(Path(shard.path)):
                names = [
                    shared_name(share.name, int(e.name.removesuffix(_SUFFIX), 16))
                    for e in os.scandir(share.path)
                    if _is_version(e.name) and len(share.name) == 32
                ]
                self._release_shared(names)
        return self._stats.snapshot().get("shared_collected", 0) - before

    def _collect_garbage(self, directory: Path, blocks_dir: Path, manifest: Manifest) -> None:
        """Remove block files and crashed writers' temp files the manifest does not reference.

        Runs under the agent's lock, so no other writer has files in flight here.
        """
        keep = {f"{ref.name}{_SUFFIX}" for ref in manifest.blocks}
        garbage = [e.path for e in os.scandir(blocks_dir) if e.name not in keep]
        garbage += [e.path for e in os.scandir(directory) if e.name.startswith(".tmp-")]
        for path in garbage:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self._release_shared(os.path.basename(path).removesuffix(_SUFFIX) for path in garbage)

    # --- anonymous prefixes --------------------------------------------------------------------
    def _hold_path(self, name: str) -> Path:
        return self._prefixes / name[:2] / f"{name}{_SUFFIX}"

    def _hold_blocks(
        self,
        blocks: Sequence[tuple[str, int, int]],
        new: Mapping[int, EncodedBlock],
        send: Collection[int],
        when: Sequence[float],
    ) -> HoldAttempt:
        """Per block: write it into `prefixes/` and publish it to `shared/` (those to send), or hard-link
        the stored version into `prefixes/`. Links never replace a file, so concurrent writers of one
        block keep one copy (a write that found another's is not counted written); the link count keeps
        counting references. A version unlinked before its link is reported missing."""
        missing: list[int] = []
        written: list[int] = []
        for index, ((name, _nbytes, _crc), used) in enumerate(zip(blocks, when, strict=True)):
            if index in send:
                if self._write_hold(name, new[index], used):
                    written.append(index)
            elif not self._hold(name, used):
                missing.append(index)
        return HoldAttempt(missing=missing, written=written)

    def _hold(self, name: str, when: float) -> bool:
        """Link the stored version `name` into `prefixes/` (or find it there) and set its last use;
        False if it is not stored (or was collected a moment ago)."""
        hold = self._hold_path(name)
        source = self._shared_path(name)
        if source is None:
            return False
        if not hold.exists():
            hold.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(source, hold)
            except FileNotFoundError:
                return False
            except FileExistsError:
                pass  # another writer held it first
        return _set_mtime(hold, when)

    def _write_hold(self, name: str, block: EncodedBlock, when: float) -> bool:
        """Write a new block into `prefixes/` and publish it to `shared/`; False if another writer's
        copy got there first (then held as it is)."""
        hold = self._hold_path(name)
        hold.parent.mkdir(parents=True, exist_ok=True)
        tmp = hold.parent / _temp_name()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _write_all(fd, block.parts())
            if self.fsync:
                os.fdatasync(fd)  # agents may link it: its bytes must be durable before it is found
        finally:
            os.close(fd)
        try:
            os.link(tmp, hold)  # never replaces: the copy agents may already link stays the one
            wrote = True
        except FileExistsError:
            wrote = False
        finally:
            os.unlink(tmp)
        _set_mtime(hold, when)
        target = self._shared_path(name)
        if target is not None:
            target.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError, FileNotFoundError):
                os.link(hold, target)
        return wrote

    def _touch_prefix(self, blocks: Sequence[tuple[str, int]], when: Sequence[float]) -> None:
        for (name, _nbytes), used in zip(blocks, when, strict=True):
            _set_mtime(self._hold_path(name), used)

    def _prefix_entries(self) -> list[PrefixEntry]:
        entries = []
        for shard in _scandir(self._prefixes):
            for entry in os.scandir(shard.path):
                name = entry.name.removesuffix(_SUFFIX)
                try:
                    stat = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if entry.name.startswith(".tmp-"):
                    if time.time() - stat.st_mtime > _STALE_TEMP_S:  # a crashed writer's
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(entry.path)
                    continue
                if parse_shared_name(name) is None:
                    continue
                entries.append(
                    PrefixEntry(name, stat.st_size, stat.st_mtime, self._agents_linking(name, stat))
                )
        return entries

    def _agents_linking(self, name: str, hold: os.stat_result) -> int:
        """How many links to a held block are agents' (not the hold, not the shared index)."""
        indexed = 0
        path = self._shared_path(name)
        with contextlib.suppress(FileNotFoundError):
            indexed = int(path is not None and os.stat(path).st_ino == hold.st_ino)
        return hold.st_nlink - 1 - indexed

    def _shared_users(self, name: str) -> int:
        try:
            return self._agents_linking(name, os.stat(self._hold_path(name)))
        except FileNotFoundError:
            pass  # not held: only the index's link is not an agent's
        path = self._shared_path(name)
        try:
            return 0 if path is None else os.stat(path).st_nlink - 1
        except FileNotFoundError:
            return 0

    def _drop_hold(self, entry: PrefixEntry) -> bool:
        """Unlink the hold, then collect the block if only the index links it: an agent linking it
        at the same moment keeps its own link, so a block in use is never lost."""
        try:
            os.unlink(self._hold_path(entry.name))
        except FileNotFoundError:
            return False
        self._release_shared([entry.name])
        return True

    # --- delete, list, info, budgets -----------------------------------------------------------
    def _handle(self, agent_id: str) -> str:
        return agent_key(agent_id)

    def _delete_manifest(
        self, guard: None, handle: str, current: Blob | None
    ) -> builtins.list[tuple[BlockRef, int]]:
        """Under the agent's lock: the swap never fails, and its shared blocks are collected here."""
        self._remove_locked(handle)
        return []

    def _remove_locked(self, key: str) -> bool:
        directory = self._dir(key)
        try:
            os.unlink(directory / MANIFEST)  # first: from here on every reader misses
            existed = True
        except FileNotFoundError:
            existed = False
        try:
            held = [e.name.removesuffix(_SUFFIX) for e in os.scandir(directory / "blocks")]
        except FileNotFoundError:
            held = []
        shutil.rmtree(directory, ignore_errors=True)
        self._release_shared(held)
        return existed

    def _keys(self) -> Iterator[str]:
        for shard in _scandir(self._agents):
            for agent in _scandir(Path(shard.path)):
                yield agent.name

    def _info_record(self, agent_id: str) -> tuple[Blob, float, bool] | None:
        key = agent_key(agent_id)
        record = self._record(key)
        return None if record is None else (*record, self._pinned(key))

    def _set_pinned(self, agent_id: str, pinned: bool) -> bool:
        """The `pinned` file: written under the agent's lock (a delete or an expiry of this agent runs
        under the same lock), unlinked without it."""
        key = agent_key(agent_id)
        if not pinned:
            try:
                os.unlink(self._dir(key) / PIN)
            except FileNotFoundError:
                return False
            return True
        with self._locked(key):
            if not (self._dir(key) / MANIFEST).exists():
                return False
            _write_atomic(self._dir(key) / PIN, [b""], fsync=self.fsync)
        return True

    def _usage(self) -> builtins.list[Usage]:
        usage = []
        for key in self._keys():
            record = self._record(key)
            if record is None:
                continue  # being written for the first time, deleted meanwhile, or expired
            blob, last_used = record
            try:
                summary = summarize_manifest(blob)
                own, shared = split_shared(summary.blocks)
                pinned = self._pinned(key)
                usage.append(Usage(key, summary.agent_id, own + len(blob), last_used, shared, pinned))
            except BadCacheError:
                # A damaged cache still takes space: count what its directory holds.
                usage.append(Usage(key, None, _tree_bytes(self._dir(key)), last_used))
        return usage


def _ours(name: str) -> bool:
    """Names a store (or another process creating it right now) puts in its root."""
    return name in ("agents", "locks", "shared", "prefixes", MARKER) or name.startswith(".tmp-")


def _is_version(name: str) -> bool:
    """A file of the shared index: `<crc32 as 8 hex digits>.safetensors`."""
    stem = name.removesuffix(_SUFFIX)
    return name.endswith(_SUFFIX) and len(stem) == 8 and all(c in "0123456789abcdef" for c in stem)


def _set_mtime(path: Path, when: float) -> bool:
    """Record `when` as the file's last use (its mtime); False if it is gone."""
    stamp = int(when * 1e9)
    try:
        os.utime(path, ns=(stamp, stamp))
    except FileNotFoundError:
        return False
    return True


def _read_all(paths: Sequence[Path]) -> list[tuple[Blob, int] | None]:
    """Read and checksum files on the helper threads: one file's CRC overlaps the next read."""

    def fetch(path: Path) -> tuple[Blob, int] | None:
        try:
            blob = _read_file(path)
        except FileNotFoundError:
            return None
        return blob, crc32(blob)

    return map_parallel(fetch, paths)


def _scandir(path: Path) -> list[os.DirEntry[str]]:
    try:
        return [entry for entry in os.scandir(path) if entry.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []


def _tree_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(root, name)).st_size
    return total


def _read_file(path: Path) -> bytes:
    """The whole file as one bytes object (numpy views of it are zero-copy, read-only, aligned).

    bytes, not a bytearray: a bytearray is zero-filled first, an extra pass over memory.
    """
    with open(path, "rb", buffering=0) as f:
        return f.read()


def _read_if_present(path: Path) -> bytes | None:
    try:
        return _read_file(path)
    except FileNotFoundError:
        return None


def _make_dirs(path: Path, *, fsync: bool) -> None:
    """`mkdir -p` that also makes each new directory's entry durable (an fsync of its parent),
    so a block renamed into a new directory cannot vanish with it after a power loss."""
    if path.is_dir():
        return
    _make_dirs(path.parent, fsync=fsync)
    try:
        path.mkdir()
    except FileExistsError:
        return
    if fsync:
        _fsync_dir(path.parent)


def _write_all(fd: int, parts: Sequence[bytes | memoryview]) -> None:
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        batch = views[:_IOV_MAX]
        written = os.writev(fd, batch)
        # Drop what was written; a short write leaves the rest of a piece for the next call.
        while batch and written >= len(batch[0]):
            written -= len(batch[0])
            batch.pop(0)
            views.pop(0)
        if written:
            views[0] = views[0][written:]


_temp_counter = itertools.count()


def _temp_name() -> str:
    """Unique among live writers: an agent's files are only written under its lock, and the
    process and thread ids tell apart the writers of the store root's own files."""
    return f".tmp-{os.getpid()}-{threading.get_ident()}-{next(_temp_counter)}"


def _write_atomic(path: Path, parts: Sequence[bytes | memoryview], *, fsync: bool) -> None:
    tmp = path.with_name(_temp_name())
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _write_all(fd, parts)
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
        _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
