"""BlockStore: the store policy, written once over the primitives DiskStore and RedisStore supply.

Here: the read path, cross-agent warm starts, delete (a compare-and-swap of the manifest to nothing),
pins, info and list; prefix holds (store/prefix_holds.py) and byte budgets (store/budget.py) are mixed
in, and the put (planning, writing, the guarded compare-and-swap) is store/commit.py's.

The backend interface, every primitive a backend supplies, grouped as issue #41 names them. The
decisions, retries, counts and logs around them are the policy's:

  get
    _read_manifest(agent_id)              the manifest as stored; None if absent (or past the TTL)
    _fetch_blocks(agent_id, manifest, refs)  blocks' blobs with their CRC-32 (agent None: shared area)
    _find_versions(shares)                the stored version of each share key, None where none is
    _info_record(agent_id)                the manifest, its last use and its pin, read together
  put-many
    _write_blocks(agent_id, plan)         a plan's new blocks, durable, not yet referenced
    _discard(agent_id, blocks)            delete own new blocks of a plan that is not swapped in
  compare-and-swap of the manifest
    _manifest_guard(handle)               the guard (a lock, a WATCH) and the manifest read under it
    _blocks_exist(guard, agent_id, refs)  whether blocks the swap keeps or links are stored, held so
    _swap_manifest(guard, agent_id, ...)  the swap, dropping what only the replaced manifest used
  delete
    _delete_manifest(guard, handle, current)  the agent's manifest, blocks and references, atomically
    _handle(agent_id)                     the key the guard, the delete and `_usage` name an agent by
  refcounts
    _collect_shared(released)             delete the released shared blocks nobody references
    _shared_users(name)                   how many agents reference a shared block
    _hold_blocks(hold)                    the prefix hold on blocks, writing the new ones first
    _touch_prefix(blocks, when)           record held blocks' last use
    _prefix_entries()                     every held block, with its agents' references
    _drop_hold(entry)                     drop a prefix hold, and the block if then unreferenced
  recency, pins, usage
    _touch(agent_id, manifest)            record a use (LRU recency; a sliding TTL)
    _set_pinned(agent_id, pinned)         set or clear the pin mark
    _usage()                              every agent as the budget and `list` see it

Reading is lock-free: a reader that finds a block gone re-reads the manifest, and if a newer
generation replaced it meanwhile it simply reads again; only if the same manifest
still points at a missing block is the cache broken.
"""

from __future__ import annotations

import builtins
from abc import abstractmethod
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from engine.core.blocks import AgentCache
from producer.wire.ids import validate_agent_id
from store.backend import Blob, race_attempts
from store.base import CacheInfo, log, note_miss, record_miss, shared_prefix
from store.block_codec import decode_block
from store.budget import ByteBudget, split_shared
from store.errors import (
    ABSENT,
    BACKEND_ERROR,
    DAMAGE,
    MISSING_BLOCK,
    NAMESPACE_MISMATCH,
    NO_COMMON_PREFIX,
    UNEXPECTED,
    BadCacheError,
    StoreError,
)
from store.manifest import (
    BlockRef,
    Manifest,
    chain_keys,
    decode_manifest,
    share_keys,
    summarize_manifest,
)
from store.prefix_holds import PrefixHolds

_READ_ATTEMPTS = 3


class _Rewritten(Exception):
    """A block vanished because a writer replaced the manifest meanwhile: read again."""


class BlockStore(PrefixHolds, ByteBudget):
    """A backend that stores caches itself: the policy over its primitives (put: store/commit.py)."""

    # --- raw storage, supplied by each backend -------------------------------------------------
    @abstractmethod
    def _read_manifest(self, agent_id: str) -> Blob | None:
        """get: the agent's manifest as stored, None if absent or expired (the backend's TTL)."""

    @abstractmethod
    def _fetch_blocks(
        self, agent_id: str | None, manifest: Manifest, refs: Sequence[BlockRef]
    ) -> list[tuple[Blob, int] | None]:
        """get, many: each block's blob with its CRC-32 (computed while the next one is read), None
        where missing; `agent_id` None reads the shared area every agent of the namespace finds."""

    @abstractmethod
    def _touch(self, agent_id: str, manifest: Manifest) -> None:
        """Record that the agent was just used: its recency for LRU eviction and `info`, and where
        the backend keeps a TTL, its sliding expiry (a backend primitive: an mtime, an EXPIRE)."""

    @abstractmethod
    def _info_record(self, agent_id: str) -> tuple[Blob, float, bool] | None:
        """The agent's manifest as stored, its last use and whether it is pinned, read together (one
        round trip in Redis); None if absent (or expired)."""

    def _handle(self, agent_id: str) -> str:
        """The handle the guard, `_remove` and `Usage` know the agent by: its id, unless the backend keys
        agents otherwise (disk: a key that also names a damaged cache whose manifest no longer says its
        agent)."""
        return agent_id

    @abstractmethod
    def _set_pinned(self, agent_id: str, pinned: bool) -> bool:
        """Set or clear the agent's pin mark (and, where keys expire, lift or restore their TTL):
        pinning is False if the agent has no cache, unpinning False if it was not pinned."""

    def list(self) -> builtins.list[str]:
        """Every agent the store holds and has not expired: what the budget sees (`_usage`), less the
        damaged caches that no longer name their agent."""
        return sorted(entry.agent_id for entry in self._usage() if entry.agent_id is not None)

    # --- the compare-and-swap's guard, and delete as a swap to nothing --------------------------
    @abstractmethod
    def _manifest_guard(self, handle: str) -> AbstractContextManager[tuple[Any, Blob | None]]:
        """The compare-and-swap's guard over an agent's manifest (by its `_handle`), from reading it to
        swapping it (a primitive: disk's flock, or Redis's optimistic WATCH that makes the swap fail if
        another writer swapped first); yields what the swap takes and the manifest as stored under it
        (no TTL check: an expired cache still lends its fence and its blocks)."""

    @abstractmethod
    def _delete_manifest(
        self, guard: Any, handle: str, current: Blob | None
    ) -> Sequence[tuple[BlockRef, int]] | None:
        """delete, under the guard: the agent's manifest, its own blocks, its index entries and its
        references on shared blocks, atomically (even where `current` is None: what a crash left);
        None if another writer swapped first. Returns the shared blocks (with their part size) it
        released that are still to collect. A primitive: a directory removal under the lock on disk,
        one MULTI/EXEC in Redis."""

    def _collect_shared(self, released: Sequence[tuple[BlockRef, int]]) -> None:
        """After a swap or delete: delete the released shared blocks no user holds any more (none are
        left where the swap itself collects them)."""
        return None

    def _remove(self, handle: str, only_if: bytes | None = None) -> bool:
        """delete: one agent's cache by its usage handle, by a guarded swap of its manifest to nothing;
        False if it was already gone. With `only_if`, only while its manifest still holds exactly those
        bytes (a damaged cache no writer replaced)."""
        for _attempt in race_attempts():
            with self._manifest_guard(handle) as (guard, current):
                if only_if is not None and (current is None or bytes(current) != only_if):
                    return False
                released = self._delete_manifest(guard, handle, current)
                if released is None:
                    continue  # another writer swapped first
            self._collect_shared(released)
            return current is not None
        raise StoreError(f"delete of agent {handle!r} kept losing races with other writers")

    # --- the calls, written once over the primitives --------------------------------------------
    def delete(self, agent_id: str) -> bool:
        existed = self._remove(self._handle(validate_agent_id(agent_id)))
        if existed:
            self._stats.add("deletes")
        return existed

    def pin(self, agent_id: str) -> bool:
        """Keep the agent's cache past the store's budget and TTL; False if there is none to pin."""
        return self._set_pinned(validate_agent_id(agent_id), True)

    def unpin(self, agent_id: str) -> bool:
        """Let budget and TTL apply to the agent again; False if it was not pinned."""
        return self._set_pinned(validate_agent_id(agent_id), False)

    def info(self, agent_id: str) -> CacheInfo | None:
        """What the agent's manifest says (no block is read, no model needed); None if there is no
        intact manifest of this agent."""
        record = self._info_record(validate_agent_id(agent_id))
        if record is None:
            return None
        blob, last_used, pinned = record
        try:
            summary = summarize_manifest(blob)
        except BadCacheError:
            return None
        if summary.agent_id != agent_id:
            return None
        return CacheInfo(
            agent_id=agent_id,
            n_tokens=summary.n_tokens,
            nbytes=summary.block_bytes + len(blob),
            last_used=last_used,
            quantization=summary.quantization,
            n_blocks=summary.n_blocks,
            shared_blocks=len(split_shared(summary.blocks)[1]),
            pinned=pinned,
            namespace=summary.namespace,
        )

    # --- reads ---------------------------------------------------------------------------------
    def get(
        self, agent_id: str, *, prompt_tokens: Sequence[int] | None = None, namespace: str | None = None
    ) -> AgentCache | None:
        validate_agent_id(agent_id)
        namespace = self.effective_namespace(namespace)
        self._stats.add("gets")
        cache = self._own_cache(agent_id, prompt_tokens, namespace)
        if prompt_tokens is not None:
            have = 0 if cache is None else cache.n_tokens
            warm = self._warm_start(agent_id, prompt_tokens, have, namespace)
            if warm is not None:
                self._stats.add("cross_agent_hits")
                cache = warm
        self._stats.add("hits" if cache is not None else "misses")
        return cache

    def _own_cache(
        self, agent_id: str, prompt_tokens: Sequence[int] | None, namespace: str
    ) -> AgentCache | None:
        """The agent's own cache, or None with the reason counted (`miss_<reason>`) and logged."""
        try:
            return self._load(agent_id, prompt_tokens, namespace)
        except BadCacheError as exc:
            note_miss(self._stats, self.kind, agent_id, exc.reason, exc.detail)
            if exc.reason in DAMAGE and exc.manifest_blob is not None:
                self._discard_damaged(agent_id, exc.manifest_blob)
        except self._io_errors() as exc:
            note_miss(self._stats, self.kind, agent_id, BACKEND_ERROR, repr(exc))
        except Exception as exc:  # never let a read take the worker down: prefill instead
            note_miss(self._stats, self.kind, agent_id, UNEXPECTED, repr(exc))
            log.exception("%s: unexpected error reading agent %r", self.kind, agent_id)
        return None

    # --- cross-agent warm start ----------------------------------------------------------------
    def _warm_start(
        self, agent_id: str, prompt_tokens: Sequence[int], have: int, namespace: str
    ) -> AgentCache | None:
        """The longest run of full blocks of this prompt that any agent of the namespace stored,
        if it covers more than the `have` tokens the agent's own cache gives; else None."""
        found = self._shared_run(agent_id, prompt_tokens, have, namespace)
        return None if found is None else found[0]

    def _shared_run(
        self, label: str, prompt_tokens: Sequence[int], have: int, namespace: str
    ) -> tuple[AgentCache, tuple[BlockRef, ...]] | None:
        """The longest run of full blocks of the prompt in the namespace's shared area, decoded, with
        the blocks it read, if it covers more than `have` tokens; else None. A damaged block ends the
        run (counted in `prefix_damaged`, and dropped if only the prefix budget holds it)."""
        if not self.spec.all_full_attention:
            return None  # windows and checkpoints make a resume point more than a token prefix
        block_tokens = self.spec.block_tokens
        prompt = np.asarray(prompt_tokens, dtype=np.int64)
        n_full = len(prompt) // block_tokens
        if n_full * block_tokens <= have:
            return None
        tokens = prompt[: n_full * block_tokens]
        layouts = [""] * n_full  # every full block of a plain model holds all its layers' tokens
        try:
            chains = chain_keys(self.spec, self.quantization, self.group_size, tokens.tolist(), layouts)
            found = self._find_shared(share_keys(chains, namespace, self.part_bytes))
            if len(found) * block_tokens <= have:
                return None
            refs = tuple(
                BlockRef(name, chain, block_tokens, nbytes, crc)
                for (name, nbytes, crc), chain in zip(found, chains, strict=False)
            )
            manifest = Manifest(
                agent_id=label,
                spec=self.spec,
                quantization=self.quantization,
                group_size=self.group_size,
                token_ids=tokens[: len(refs) * block_tokens],
                blocks=refs,
                generation="",
                created=0.0,
                part_bytes=self.part_bytes,
            )
            fetched = self._fetch_blocks(None, manifest, refs)
        except self._io_errors() as exc:
            log.warning("%s: could not read shared blocks for %r: %r", self.kind, label, exc)
            return None
        blocks = []
        for ref, got in zip(refs, fetched, strict=True):
            if got is None:
                break  # collected while we read: the run ends here
            try:
                blocks.append(decode_block(got[0], ref, manifest, crc=got[1]))
            except BadCacheError as exc:
                log.warning("%s: a shared block read for %r is unusable: %s", self.kind, label, exc)
                self._stats.add("prefix_damaged")
                self._drop_damaged_prefix(ref)
                break
        covered = len(blocks) * block_tokens
        if covered <= have:
            return None
        refs = refs[: len(blocks)]
        self._stats.add("bytes_read", sum(ref.nbytes for ref in refs))
        log.debug("%s: %r starts from %d shared tokens", self.kind, label, covered)
        return AgentCache(self.spec, tokens[:covered].tolist(), blocks), refs

    def _find_shared(self, shares: Sequence[str]) -> builtins.list[tuple[str, int, int]]:
        """(name, nbytes, crc32) of a stored version of each share key, in order, up to the first
        key with none (the longest run from the start)."""
        found = []
        for version in self._find_versions(shares):
            if version is None:
                break
            found.append(version)
        return found

    def record_miss(self, agent_id: str, reason: str, detail: str) -> None:
        """Count and log a miss found by a layer in front of this backend (the hot tier)."""
        record_miss(self._stats, self.kind, agent_id, reason, detail)

    def _discard_damaged(self, agent_id: str, manifest_blob: Blob) -> None:
        """Delete a damaged cache, unless a writer replaced its manifest since it was read.

        Otherwise the next put would keep referencing (reusing) the damaged blocks.
        """
        try:
            if self._remove(self._handle(agent_id), only_if=bytes(manifest_blob)):
                self._stats.add("discarded")
                log.warning("%s: deleted the damaged cache of agent %r", self.kind, agent_id)
        except self._io_errors() as exc:
            log.warning("%s: could not delete the damaged cache of agent %r: %r", self.kind, agent_id, exc)

    def _load(self, agent_id: str, prompt_tokens: Sequence[int] | None, namespace: str) -> AgentCache:
        for _attempt in range(_READ_ATTEMPTS):
            blob = self._read_manifest(agent_id)
            if blob is None:
                raise BadCacheError(ABSENT, "no cache stored")
            try:
                return self._load_from(agent_id, blob, prompt_tokens, namespace)
            except _Rewritten:
                continue
            except BadCacheError as exc:
                exc.manifest_blob = blob
                raise
        raise BadCacheError(MISSING_BLOCK, f"cache kept changing during {_READ_ATTEMPTS} reads")

    def _load_from(
        self, agent_id: str, blob: Blob, prompt_tokens: Sequence[int] | None, namespace: str
    ) -> AgentCache:
        manifest = decode_manifest(blob, agent_id, self.spec)
        if (manifest.namespace or self.namespace) != namespace:  # "": written before it was recorded
            raise BadCacheError(
                NAMESPACE_MISMATCH, f"stored by namespace {manifest.namespace!r}, not {namespace!r}"
            )
        n_tokens = shared_prefix(manifest.token_ids, prompt_tokens)
        if n_tokens == 0 and manifest.n_tokens > 0:
            raise BadCacheError(NO_COMMON_PREFIX, "the prompt shares no token with the cache")
        refs = manifest.blocks[: self.spec.blocks_for(n_tokens)]
        fetched = self._fetch_blocks(agent_id, manifest, refs)
        if any(f is None for f in fetched):
            if self._manifest_generation(agent_id) != manifest.generation:
                raise _Rewritten  # rewritten while we read: read the new one
            missing = next(ref.name for ref, f in zip(refs, fetched, strict=True) if f is None)
            raise BadCacheError(MISSING_BLOCK, f"block {missing} is gone")
        present = [f for f in fetched if f is not None]
        blocks = [decode_block(b, ref, manifest, crc=c) for (b, c), ref in zip(present, refs, strict=True)]
        self._stats.add("bytes_read", len(blob) + sum(ref.nbytes for ref in refs))
        covered = sum(ref.n_tokens for ref in refs)
        cache = AgentCache(self.spec, manifest.token_ids[:covered].tolist(), blocks, manifest.conversation)
        if n_tokens < covered:
            cache = cache.truncated(n_tokens)
        try:
            self._touch(agent_id, manifest)
        except self._io_errors() as exc:  # the cache is good: only its last-used time is stale
            log.debug("%s: could not record the use of agent %r: %r", self.kind, agent_id, exc)
        return cache

    def _manifest_generation(self, agent_id: str) -> str | None:
        blob = self._read_manifest(agent_id)
        if blob is None:
            return None
        try:
            return decode_manifest(blob, agent_id, self.spec).generation
        except BadCacheError:
            return None

    def read_manifest(self, agent_id: str) -> Manifest | None:
        """The agent's manifest if it is present and intact (no block is read)."""
        blob = self._read_manifest(validate_agent_id(agent_id))
        if blob is None:
            return None
        try:
            return decode_manifest(blob, agent_id, self.spec)
        except BadCacheError:
            return None
