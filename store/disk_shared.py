"""The disk store's shared area: the index of shared (full) blocks, `shared/<share[:2]>/<share>/<crc32>`,
and the blocks held for anonymous prefixes, `prefixes/<name[:2]>/<name>` (store/disk.py's layout).

A block's hard-link count is its reference count: agents link a shared block into their own
directory, a prefix hold is one more link, and the index's link is collected once it is the last.
Links never replace a file, so concurrent writers of one block keep one copy and a block an agent
links is never lost to a collection racing it.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from store.base import log
from store.block_codec import EncodedBlock
from store.commit import NewBlock
from store.disk_files import SUFFIX, is_version, set_mtime, subdirs, temp_name, write_all
from store.manifest import parse_shared_name, shared_name
from store.prefix_holds import HoldAttempt, PrefixEntry, PrefixHold

STALE_TEMP_S = 3600.0  # a prefix writer's temp file this old was left by a crash


class SharedArea:
    """The shared index (`root`) and the prefix holds (`holds`) of one disk store."""

    def __init__(self, root: Path, holds: Path, *, fsync: bool) -> None:
        self.root = root
        self.holds = holds
        self.fsync = fsync

    def path(self, name: str) -> Path | None:
        """Where the shared index keeps a shared block's version (None for an agent's own block)."""
        parsed = parse_shared_name(name)
        if parsed is None:
            return None
        share, crc = parsed
        return self.root / share[:2] / share / f"{crc:08x}{SUFFIX}"

    def version(self, share: str) -> tuple[str, int, int] | None:
        """(name, nbytes, crc32) of a stored version of the share key; None if there is none."""
        directory = self.root / share[:2] / share
        try:
            versions = sorted(name for name in os.listdir(directory) if is_version(name))
            size = (directory / versions[0]).stat().st_size if versions else 0
        except FileNotFoundError:
            return None  # never stored, or collected a moment ago
        if not versions:
            return None
        crc = int(versions[0].removesuffix(SUFFIX), 16)
        return shared_name(share, crc), size, crc

    def link_into(self, blocks_dir: Path, block: NewBlock) -> bool:
        """Hard-link the stored version of a shared block with these exact bytes into the agent's
        directory (the link count is the reference count); False when there is none to link."""
        source = self.path(block.name) if block.share is not None else None
        if source is None:
            return False
        tmp = blocks_dir / temp_name()
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
        os.replace(tmp, blocks_dir / f"{block.name}{SUFFIX}")
        return True

    def publish(self, blocks_dir: Path, block: NewBlock) -> None:
        """Offer a new shared block to other agents: a hard link in the shared index. Best effort and
        not fsynced: losing the link (a crash, a concurrent collection) only loses the saving."""
        target = self.path(block.name)
        if target is None:
            return
        for _attempt in range(3):
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                os.link(blocks_dir / f"{block.name}{SUFFIX}", target)
                return
            except FileExistsError:
                return  # another agent stored the same bytes first
            except FileNotFoundError:
                continue  # its directory was collected between mkdir and link: again
            except OSError as exc:
                log.debug("disk: could not publish shared block %s: %r", block.name, exc)
                return

    def release(self, names: Iterable[str]) -> int:
        """Collect the shared versions of these blocks that no agent links any more (link count 1).

        A writer linking one at the same moment keeps its own link, so the race can only lose
        the index entry (a saving), never a block an agent uses. Returns how many it collected.
        """
        collected = 0
        for name in names:
            path = self.path(name)
            if path is None:
                continue
            try:
                if os.stat(path).st_nlink > 1:
                    continue
                os.unlink(path)
            except FileNotFoundError:
                continue
            collected += 1
            with contextlib.suppress(OSError):
                os.rmdir(path.parent)  # fails while another version is there
        return collected

    def collect_unused(self) -> int:
        """Collect every shared version no agent links (left by writers that crashed after
        publishing). Scans the whole index: for maintenance, not for every put. Returns how many
        were removed."""
        collected = 0
        for shard in subdirs(self.root):
            for share in subdirs(Path(shard.path)):
                names = [
                    shared_name(share.name, int(e.name.removesuffix(SUFFIX), 16))
                    for e in os.scandir(share.path)
                    if is_version(e.name) and len(share.name) == 32
                ]
                collected += self.release(names)
        return collected

    def hold_path(self, name: str) -> Path:
        return self.holds / name[:2] / f"{name}{SUFFIX}"

    def hold_all(self, hold: PrefixHold) -> HoldAttempt:
        """Per block: write it into `prefixes/` and publish it to `shared/` (those to send), or hard-link
        the stored version into `prefixes/`. Links never replace a file, so concurrent writers of one
        block keep one copy (a write that found another's is not counted written); the link count keeps
        counting references. A version unlinked before its link is reported missing."""
        missing: list[int] = []
        written: list[int] = []
        for index, ((name, _nbytes, _crc), used) in enumerate(zip(hold.blocks, hold.when, strict=True)):
            block = hold.writes(index)
            if block is not None:
                if self.write_hold(name, block, used):
                    written.append(index)
            elif not self.hold(name, used):
                missing.append(index)
        return HoldAttempt(missing=missing, written=written)

    def hold(self, name: str, when: float) -> bool:
        """Link the stored version `name` into `prefixes/` (or find it there) and set its last use;
        False if it is not stored (or was collected a moment ago)."""
        hold = self.hold_path(name)
        source = self.path(name)
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
        return set_mtime(hold, when)

    def write_hold(self, name: str, block: EncodedBlock, when: float) -> bool:
        """Write a new block into `prefixes/` and publish it to `shared/`; False if another writer's
        copy got there first (then held as it is)."""
        hold = self.hold_path(name)
        hold.parent.mkdir(parents=True, exist_ok=True)
        tmp = hold.parent / temp_name()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            write_all(fd, block.parts())
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
        set_mtime(hold, when)
        target = self.path(name)
        if target is not None:
            target.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError, FileNotFoundError):
                os.link(hold, target)
        return wrote

    def touch(self, blocks: Sequence[tuple[str, int]], when: Sequence[float]) -> None:
        for (name, _nbytes), used in zip(blocks, when, strict=True):
            set_mtime(self.hold_path(name), used)

    def entries(self) -> list[PrefixEntry]:
        entries = []
        for shard in subdirs(self.holds):
            for entry in os.scandir(shard.path):
                name = entry.name.removesuffix(SUFFIX)
                try:
                    stat = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if entry.name.startswith(".tmp-"):
                    if time.time() - stat.st_mtime > STALE_TEMP_S:  # a crashed writer's
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
        path = self.path(name)
        with contextlib.suppress(FileNotFoundError):
            indexed = int(path is not None and os.stat(path).st_ino == hold.st_ino)
        return hold.st_nlink - 1 - indexed

    def users(self, name: str) -> int:
        try:
            return self._agents_linking(name, os.stat(self.hold_path(name)))
        except FileNotFoundError:
            pass  # not held: only the index's link is not an agent's
        path = self.path(name)
        try:
            return 0 if path is None else os.stat(path).st_nlink - 1
        except FileNotFoundError:
            return 0

    def drop_hold(self, name: str) -> int | None:
        """Unlink the hold, then collect the block if only the index links it: an agent linking it
        at the same moment keeps its own link, so a block in use is never lost. None if there was
        no hold; else how many versions it collected (0 or 1)."""
        try:
            os.unlink(self.hold_path(name))
        except FileNotFoundError:
            return None
        return self.release([name])
