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
import json
import os
import shutil
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

from engine.core.spec import ModelCacheSpec
from store.agent_ids import agent_key
from store.backend import BackendOptions, Blob
from store.budget import Usage, split_shared
from store.commit import NewBlock, WritePlan, WritingBackend
from store.disk_files import (
    SUFFIX,
    fsync_dir,
    make_dirs,
    read_all,
    read_file,
    read_if_present,
    subdirs,
    temp_name,
    tree_bytes,
    write_all,
    write_atomic,
)
from store.disk_shared import SharedArea
from store.errors import BadCacheError, StoreError
from store.iopool import submit
from store.manifest import (
    BlockRef,
    Manifest,
    summarize_manifest,
)
from store.prefix_holds import HoldAttempt, PrefixEntry, PrefixHold

MARKER = "kvrq-store.json"
if TYPE_CHECKING:
    from typing_extensions import Unpack

_MARKER_CONTENT = {"format": "kvrq-store", "layout": 1}
MANIFEST = "manifest.safetensors"
PIN = "pinned"


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
        self.shared = SharedArea(self.root / "shared", self.root / "prefixes", fsync=fsync)
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
            write_atomic(marker, [json.dumps(_MARKER_CONTENT).encode()], fsync=self.fsync)
        self._agents.mkdir(exist_ok=True)
        self._locks.mkdir(exist_ok=True)
        self.shared.root.mkdir(exist_ok=True)
        self.shared.holds.mkdir(exist_ok=True)

    # --- paths ---------------------------------------------------------------------------------
    def _dir(self, key: str) -> Path:
        return self._agents / key[:2] / key

    def _agent_dir(self, agent_id: str) -> Path:
        return self._dir(agent_key(agent_id))

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
            return read_file(path), last_used
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
            paths = [self.shared.path(ref.name) for ref in refs]
            return read_all([path for path in paths if path is not None])
        blocks = self._agent_dir(agent_id) / "blocks"
        return read_all([blocks / f"{ref.name}{SUFFIX}" for ref in refs])

    def _find_versions(self, shares: Sequence[str]) -> Iterator[tuple[str, int, int] | None]:
        return (self.shared.version(share) for share in shares)  # lazy: a run's lookups end at its first miss

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
            yield None, read_if_present(self._dir(handle) / MANIFEST)

    def _blocks_exist(self, guard: None, agent_id: str, refs: Sequence[BlockRef]) -> bool:
        """Every block file is there with its size (under the lock no writer removes one)."""
        blocks_dir = self._agent_dir(agent_id) / "blocks"
        for ref in refs:
            try:
                if (blocks_dir / f"{ref.name}{SUFFIX}").stat().st_size != ref.nbytes:
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
        write_atomic(directory / MANIFEST, [manifest_blob], fsync=self.fsync)
        self._collect_garbage(directory, directory / "blocks", manifest)
        return []

    def _write_blocks(self, agent_id: str, plan: WritePlan) -> list[NewBlock]:
        """Link the shared blocks some agent already stored, write the rest; returns those linked.

        Written blocks go to a temp file each and are synced (each block's fdatasync starts on a
        helper thread as soon as it is written, so the disk flushes one block while the next is
        written), then renamed into place; new shared blocks are then published to the index.
        """
        blocks_dir, blocks = self._agent_dir(agent_id) / "blocks", plan.new_blocks
        make_dirs(blocks_dir, fsync=self.fsync)  # the manifest's directory too
        linked = [block for block in blocks if self.shared.link_into(blocks_dir, block)]
        linked_ids = {id(block) for block in linked}
        to_write = [block for block in blocks if id(block) not in linked_ids]
        pending: list[tuple[int, Path, Path]] = []
        syncs: list[Future[None]] = []
        try:
            for block in to_write:
                tmp = blocks_dir / temp_name()
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                pending.append((fd, tmp, blocks_dir / f"{block.name}{SUFFIX}"))
                write_all(fd, block.encoded.parts())
                if self.fsync:
                    syncs.append(submit(os.fdatasync, fd))
            for sync in syncs:
                sync.result()
            for fd, tmp, final in pending:
                os.close(fd)
                os.replace(tmp, final)
            pending = []
            if self.fsync and blocks:
                fsync_dir(blocks_dir)  # the renames and links: the manifest may now name them
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
                self.shared.publish(blocks_dir, block)
        return linked

    def _release_shared(self, names: Iterable[str]) -> None:
        self._count_collected(self.shared.release(names))

    def _count_collected(self, collected: int | None) -> None:
        """Shared block versions removed because no agent or prefix holds them any more."""
        if collected:
            self._stats.add("shared_collected", collected)

    def collect_shared_garbage(self) -> int:
        """Collect every shared version no agent links (left by writers that crashed after
        publishing). Scans the whole index: for maintenance, not for every put. Returns how many
        were removed."""
        collected = self.shared.collect_unused()
        self._count_collected(collected)
        return collected

    def _collect_garbage(self, directory: Path, blocks_dir: Path, manifest: Manifest) -> None:
        """Remove block files and crashed writers' temp files the manifest does not reference.

        Runs under the agent's lock, so no other writer has files in flight here.
        """
        keep = {f"{ref.name}{SUFFIX}" for ref in manifest.blocks}
        garbage = [e.path for e in os.scandir(blocks_dir) if e.name not in keep]
        garbage += [e.path for e in os.scandir(directory) if e.name.startswith(".tmp-")]
        for path in garbage:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self._release_shared(os.path.basename(path).removesuffix(SUFFIX) for path in garbage)

    # --- anonymous prefixes --------------------------------------------------------------------
    def _hold_blocks(self, hold: PrefixHold) -> HoldAttempt:
        return self.shared.hold_all(hold)

    def _touch_prefix(self, blocks: Sequence[tuple[str, int]], when: Sequence[float]) -> None:
        self.shared.touch(blocks, when)

    def _prefix_entries(self) -> list[PrefixEntry]:
        return self.shared.entries()

    def _shared_users(self, name: str) -> int:
        return self.shared.users(name)

    def _drop_hold(self, entry: PrefixEntry) -> bool:
        collected = self.shared.drop_hold(entry.name)
        self._count_collected(collected)
        return collected is not None

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
            held = [e.name.removesuffix(SUFFIX) for e in os.scandir(directory / "blocks")]
        except FileNotFoundError:
            held = []
        shutil.rmtree(directory, ignore_errors=True)
        self._release_shared(held)
        return existed

    def _keys(self) -> Iterator[str]:
        for shard in subdirs(self._agents):
            for agent in subdirs(Path(shard.path)):
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
            write_atomic(self._dir(key) / PIN, [b""], fsync=self.fsync)
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
                usage.append(Usage(key, None, tree_bytes(self._dir(key)), last_used))
        return usage


def _ours(name: str) -> bool:
    """Names a store (or another process creating it right now) puts in its root."""
    return name in ("agents", "locks", "shared", "prefixes", MARKER) or name.startswith(".tmp-")
