"""The put, written once: plan the blocks against the previous manifest, write the new ones, then
swap the manifest in by a guarded compare-and-swap under the fence.

WritingBackend is the base of the backends that store blocks themselves (DiskStore, RedisStore) and
supplies their `_write`; they supply its primitives (store/policy.py lists them all): put-many
(`_write_blocks`, `_discard`) and the manifest's compare-and-swap (`_manifest_guard`, which the
delete shares, `_blocks_exist`, `_swap_manifest`), retried while `race_attempts` allow (a swap under
disk's lock fails only where a block it links was collected meanwhile: it is planned again). A store
that routes each put to another store (ShardedStore) is a plain BlockBackend and has none of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.core.blocks import AgentCache
from store.backend import Blob, race_attempts
from store.base import log
from store.block_codec import EncodedBlock, encode_block
from store.errors import BadCacheError, StoreError
from store.manifest import (
    BlockRef,
    Manifest,
    block_name,
    chain_keys,
    decode_manifest,
    encode_manifest,
    new_generation,
    share_keys,
    shared_name,
    stored_fence,
)
from store.policy import BlockStore


@dataclass(frozen=True)
class NewBlock:
    """A block a put must write (its CRC-32 may still be computing), or link if it is shared.

    A full block carries its content key (`share`): it is stored once for every agent of the
    namespace under `shared_name(share, crc32)`, so its name waits for its CRC-32.
    """

    own_name: str
    chain: str
    n_tokens: int
    encoded: EncodedBlock
    share: str | None = None

    @property
    def name(self) -> str:
        return self.own_name if self.share is None else shared_name(self.share, self.encoded.crc32)

    def ref(self) -> BlockRef:
        return BlockRef(self.name, self.chain, self.n_tokens, self.encoded.nbytes, self.encoded.crc32)


@dataclass
class WritePlan:
    """A put worked out against the previous manifest: blocks to write and blocks to keep, in order."""

    draft: Manifest  # every field but `blocks`
    slots: list[BlockRef | NewBlock]

    @property
    def new_blocks(self) -> list[NewBlock]:
        return [slot for slot in self.slots if isinstance(slot, NewBlock)]

    @property
    def reused(self) -> int:
        return sum(1 for slot in self.slots if isinstance(slot, BlockRef))

    @property
    def new_shared(self) -> list[BlockRef]:
        """The shared blocks this plan writes or links: the agent does not reference them yet."""
        return [slot.ref() for slot in self.new_blocks if slot.share is not None]

    @property
    def kept(self) -> list[BlockRef]:
        """Blocks this plan references without writing them (reused from the previous manifest)."""
        return [slot for slot in self.slots if isinstance(slot, BlockRef)]

    def manifest(self) -> Manifest:
        """The manifest to swap in once the new blocks are written (waits for their CRCs)."""
        refs = tuple(slot.ref() if isinstance(slot, NewBlock) else slot for slot in self.slots)
        return dataclasses.replace(self.draft, blocks=refs)


class WritingBackend(BlockStore):
    """The put of a BlockStore, over its put-many and compare-and-swap."""

    def _write(self, agent_id: str, cache: AgentCache, fence: int | None, namespace: str) -> bool:
        """`put` once its arguments are checked (a replicated Redis confirms it on its replicas)."""
        return self._commit_put(agent_id, cache, fence, namespace) is not None

    def _fence_for(self, agent_id: str, fence: int | None, stored: int) -> int | None:
        """The fence the new manifest carries, or None if the put is stale (then counted and logged).

        An unfenced put keeps the stored fence, so fences never go backwards.
        """
        if fence is None:
            return stored
        if fence < stored:
            self._stats.add("stale_puts")
            log.warning(
                "%s: dropped a stale put of agent %r: its fence %d is below the stored fence %d",
                self.kind,
                agent_id,
                fence,
                stored,
            )
            return None
        return fence

    def plan_write(
        self,
        agent_id: str,
        cache: AgentCache,
        previous: Manifest | None,
        *,
        fence: int = 0,
        namespace: str | None = None,
    ) -> WritePlan:
        """Encode the blocks `previous` does not already hold; keep (by reference) those it does.
        Full blocks go to `namespace`'s shared area (None: the store's)."""
        namespace = self.effective_namespace(namespace)
        cache.validate(self.spec)
        generation = new_generation()
        layouts = [block.layout() for block in cache.blocks]  # a window or checkpoint makes another block
        chains = chain_keys(self.spec, self.quantization, self.group_size, cache.token_ids, layouts)
        reusable: dict[tuple[str, int], BlockRef] = {}
        if previous is not None and (
            previous.quantization,
            previous.group_size,
            previous.part_bytes,
            previous.namespace or self.namespace,
        ) == (self.quantization, self.group_size, self.part_bytes, namespace):
            reusable = {(ref.chain, ref.n_tokens): ref for ref in previous.blocks}
        shares = share_keys(chains, namespace, self.part_bytes)
        slots: list[BlockRef | NewBlock] = []
        for block, chain, share, layout in zip(cache.blocks, chains, shares, layouts, strict=True):
            kept = reusable.get((chain, block.n_tokens))
            if kept is not None:
                slots.append(kept)
                continue
            encoded = encode_block(block, self.spec, self.quantization, self.group_size)
            # Full blocks holding every layer's tokens are stored once per namespace, the rest per agent.
            shareable = block.n_tokens == self.spec.block_tokens and layout == ""
            name = block_name(chain, generation)
            slots.append(NewBlock(name, chain, block.n_tokens, encoded, share if shareable else None))
        draft = Manifest(
            agent_id=agent_id,
            spec=self.spec,
            quantization=self.quantization,
            group_size=self.group_size,
            token_ids=np.asarray(cache.token_ids, dtype=np.int64),
            blocks=(),
            generation=generation,
            created=time.time(),
            fence=fence,
            part_bytes=self.part_bytes,
            namespace=namespace,
            conversation=cache.conversation,
        )
        return WritePlan(draft, slots)

    def _commit_put(
        self, agent_id: str, cache: AgentCache, fence: int | None, namespace: str
    ) -> bytes | None:
        """Write the cache's blocks, then compare-and-swap its manifest under the fence; the manifest
        as stored, or None when the put is stale.

        The swap is guarded by the backend (`_manifest_guard`: WATCH on the manifest key in Redis, the
        agent's lock on disk): it fails only if another writer swapped meanwhile, and the put then
        commits again, re-planned only if blocks it reused are gone: last writer wins, never a mix.
        """
        plan: WritePlan | None = None
        linked: list[NewBlock] = []
        attempts = 0
        for attempts in race_attempts():
            if attempts > 1:
                self._stats.add("put_retries")
            with self._manifest_guard(self._handle(agent_id)) as (guard, current):
                # Compared under the guard: a writer that swaps the manifest in meanwhile fails our swap.
                new_fence = self._fence_for(agent_id, fence, stored_fence(current))
                if new_fence is None:
                    if plan is not None:
                        self._drop_plan(agent_id, plan)
                    return None
                if plan is None or not self._blocks_exist(guard, agent_id, plan.kept):
                    # (Re)plan; a retry whose kept blocks still exist only needs the swap again.
                    if plan is not None:
                        self._drop_plan(agent_id, plan)
                    previous = self._reusable(guard, agent_id, current)
                    plan = self.plan_write(agent_id, cache, previous, namespace=namespace)
                    linked = self._write_new_blocks(agent_id, plan)
                # Blocks the agent does not reference yet: another agent's commit may collect a shared
                # one (the blocks it keeps were checked, and are held until the swap, above).
                if not self._blocks_exist(guard, agent_id, plan.new_shared):
                    self._drop_plan(agent_id, plan)
                    plan = None  # a shared block it links was collected meanwhile: plan again
                    continue
                manifest = dataclasses.replace(plan.manifest(), fence=new_fence)
                manifest_blob = encode_manifest(manifest)
                released = self._swap_manifest(guard, agent_id, plan, manifest, manifest_blob, current)
                if released is None:
                    continue  # another writer swapped first
            self._collect_shared(released)
            self._after_put(self._handle(agent_id), self._count_put(plan, len(manifest_blob), linked))
            return manifest_blob
        if plan is not None:
            self._drop_plan(agent_id, plan)
        raise StoreError(f"put of agent {agent_id!r} lost {attempts} races with other writers")

    def _write_new_blocks(self, agent_id: str, plan: WritePlan) -> list[NewBlock]:
        """`_write_blocks`, and on failure (a full disk or Redis, a lost connection) removing what it
        wrote, best effort: what is left is garbage the next put (disk) or its expiry (Redis) clears."""
        try:
            return self._write_blocks(agent_id, plan)
        except self._io_errors():
            with contextlib.suppress(*self._io_errors()):
                self._drop_plan(agent_id, plan)
            raise

    # --- the put's primitives: put-many and a guarded compare-and-swap of the manifest ---------
    def _reusable(self, guard: Any, agent_id: str, current: Blob | None) -> Manifest | None:
        """The current manifest if a put may build on it: intact, cut into values of this store's
        size (plan_write reuses nothing else) and with every block still stored."""
        if current is None:
            return None
        try:
            previous = decode_manifest(current, agent_id, self.spec)
        except BadCacheError:
            return None
        if previous.part_bytes != self.part_bytes:
            return None
        return previous if self._blocks_exist(guard, agent_id, previous.blocks) else None

    @abstractmethod
    def _blocks_exist(self, guard: Any, agent_id: str, refs: Sequence[BlockRef]) -> bool:
        """Whether these blocks of the agent (its own, or shared) are all stored, and then held so
        under the guard until the swap. A primitive: on disk the agent's lock and the hard links in its
        directory hold them (a stat checks each), in Redis a WATCH on their values aborts the swap if
        one goes (an agent's own blocks and those it references only go in commits, which touch the
        watched manifest; a shared block it is about to link, in another agent's commit)."""

    @abstractmethod
    def _write_blocks(self, agent_id: str, plan: WritePlan) -> list[NewBlock]:
        """put-many: write the plan's new blocks (durable, not yet referenced); returns the shared ones
        found stored already and only linked. A primitive: durability is fsync and rename on disk, a
        provisional expiry in Redis, and the link to a stored shared block a hard link or no write."""

    @abstractmethod
    def _swap_manifest(
        self,
        guard: Any,
        agent_id: str,
        plan: WritePlan,
        manifest: Manifest,
        manifest_blob: bytes,
        current: Blob | None,
    ) -> Sequence[tuple[BlockRef, int]] | None:
        """The compare-and-swap: swap in the manifest and drop the blocks only the replaced one used,
        atomically; None if another writer swapped first. Returns the shared blocks (with their part
        size) it released that are still to collect. A primitive: the rename under the agent's lock on
        disk, one MULTI/EXEC (refcounts and index included) in Redis."""

    def _drop_plan(self, agent_id: str, plan: WritePlan) -> None:
        """A plan that will not be swapped in: its own new blocks go (`_discard`), and its new shared
        ones unless an agent references them (a writer about to adopt one finds it gone and writes it
        again)."""
        self._discard(agent_id, [block for block in plan.new_blocks if block.share is None])
        self._collect_shared([(block.ref(), self.part_bytes) for block in plan.new_blocks if block.share])

    def _discard(self, agent_id: str, blocks: Sequence[NewBlock]) -> None:
        """Delete these new blocks of the agent's, which no manifest references (a no-op where they are
        garbage the next put collects, as on disk under the agent's lock)."""
        return None

    def _count_put(self, plan: WritePlan, manifest_bytes: int, linked: Sequence[NewBlock] = ()) -> int:
        """Count a put; `linked`: new blocks not written because another agent had stored the same bytes.
        Returns the bytes it wrote: what the store can have grown by at most."""
        saved = sum(b.encoded.nbytes for b in linked)
        self._stats.add("puts")
        self._stats.add("blocks_written", len(plan.new_blocks) - len(linked))
        self._stats.add("blocks_reused", plan.reused)
        self._stats.add("blocks_linked", len(linked))
        written = sum(b.encoded.nbytes for b in plan.new_blocks) - saved
        self._stats.add("bytes_written", manifest_bytes + written)
        self._stats.add("bytes_saved", saved)
        return manifest_bytes + written
