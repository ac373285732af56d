"""Anonymous prefixes: full blocks held without an agent, for later jobs of the namespace, under their own
LRU byte budget (`prefix_max_bytes`).

Written once for the backends that store caches (BlockStore mixes it in): which blocks a prefix is,
the recency each block of a run records, what a put or a hit counts, and which held blocks the budget
evicts, and the put's loop (look up, encode what is missing, hold, write again what was collected
meanwhile). A hold is one more reference on a shared block; a backend supplies the hold itself
(`_hold_blocks`, `_touch_prefix`, `_drop_hold`), a share key's stored version (`_find_versions`), what
is held (`_prefix_entries`) and a block's reference count (`_shared_users`).
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from engine.core.blocks import AgentCache
from store.backend import BlockBackend, race_attempts
from store.base import log
from store.block_codec import EncodedBlock, encode_block
from store.budget import BUDGET_RESCAN_S
from store.errors import StoreError
from store.manifest import BlockRef, chain_keys, parse_shared_name, share_keys, shared_name

# A prefix touched at time t records block i at t - i * _DEPTH_STEP_S: a block is never less recent
# than the blocks after it, so LRU eviction takes a run's tail first and never strands a tail.
_DEPTH_STEP_S = 1e-6
PREFIX_LABEL = "(prefix)"  # stands for the agent id in logs of anonymous prefix reads


def prefix_times(now: float, count: int) -> list[float]:
    """The last-used time recorded for each of the `count` blocks of a prefix touched at `now`."""
    return [now - depth * _DEPTH_STEP_S for depth in range(count)]


@dataclass(frozen=True)
class PrefixEntry:
    """One block held for anonymous prefixes, as the prefix budget sees it."""

    name: str  # the shared block's name, `{share}.{crc32:08x}`
    nbytes: int
    last_used: float
    agents: int  # how many agents link it besides the prefix hold (0: the budget may evict it)
    part_bytes: int = 0


@dataclass(frozen=True)
class PrefixHold:
    """One attempt of a put_prefix, as the backend's hold takes it."""

    blocks: Sequence[tuple[str, int, int]]  # (name, nbytes, crc) of every block of the prefix
    new: Mapping[int, EncodedBlock]  # the blocks this put encoded, by index
    send: Collection[int]  # of those, the ones this attempt writes
    when: Sequence[float]  # each block's last use

    def writes(self, index: int) -> EncodedBlock | None:
        """The block to write at `index`, None where the stored version is held."""
        return self.new[index] if index in self.send else None


@dataclass(frozen=True)
class HoldAttempt:
    """What one `_hold_blocks` did: which new blocks it wrote (a write that found another writer's copy
    holds that copy and is not counted), and why the hold must be tried again, if it must."""

    written: Sequence[int] = ()
    missing: Sequence[int] = ()  # blocks collected between the lookup and the hold: written again
    lost_race: bool = False  # the atomic step lost to another writer: tried again as it is


@dataclass(frozen=True)
class PrefixWrite:
    """What a backend did for one put_prefix."""

    held: int = 0  # blocks found stored (a lookup, no encode or write), now held
    written: int = 0  # blocks encoded and written
    bytes_written: int = 0


class PrefixHolds(BlockBackend):
    """get_prefix / put_prefix and the prefix budget, over the backend's holds and reference counts."""

    _prefix_estimate: int = 0
    _prefix_last_scan: float = -float("inf")

    # --- what the store around it provides ----------------------------------------------------
    @abstractmethod
    def _shared_run(
        self, label: str, prompt_tokens: Sequence[int], have: int, namespace: str
    ) -> tuple[AgentCache, tuple[BlockRef, ...]] | None: ...

    # --- the policy ----------------------------------------------------------------------------
    def get_prefix(self, prompt_tokens: Sequence[int], *, namespace: str | None = None) -> AgentCache | None:
        """The longest run of full blocks of the prompt that any job of the namespace stored (with or
        without an agent), or None. A hit makes those blocks the most recently used prefix blocks.
        Never raises for stored data: a damaged block ends the run (`prefix_damaged`)."""
        namespace = self.effective_namespace(namespace)
        self._stats.add("prefix_gets")
        found = None
        if self.prefix_max_bytes > 0:
            found = self._shared_run(PREFIX_LABEL, prompt_tokens, 0, namespace)
        if found is None:
            self._stats.add("prefix_misses")
            return None
        cache, refs = found
        try:
            self._touch_prefix([(ref.name, ref.nbytes) for ref in refs], prefix_times(time.time(), len(refs)))
        except self._io_errors() as exc:  # the blocks are good: only their recency is stale
            log.debug("%s: could not record the use of a prefix: %r", self.kind, exc)
        self._stats.add("prefix_hits")
        self._stats.add("prefix_tokens", cache.n_tokens)
        return cache

    def put_prefix(self, cache: AgentCache, *, namespace: str | None = None) -> bool:
        """Hold the cache's full blocks in the namespace's shared area for later jobs, without an agent.

        A block some job stored already costs a lookup (it is only held and made recent); the others
        are encoded and written. Held blocks no agent links are evicted least recently used first to
        stay under `prefix_max_bytes`; blocks agents link count toward `max_bytes` and are never
        evicted by this budget. False when nothing is held (no full block, windowed model, budget 0).
        """
        namespace = self.effective_namespace(namespace)
        cache.validate(self.spec)
        if self.prefix_max_bytes == 0 or not self.spec.all_full_attention:
            return False
        block_tokens = self.spec.block_tokens
        n_full = 0
        for block in cache.blocks:
            if block.n_tokens != block_tokens or block.layout() != "":
                break
            n_full += 1
        if n_full == 0:
            return False
        tokens = cache.token_ids[: n_full * block_tokens]
        chains = chain_keys(self.spec, self.quantization, self.group_size, tokens, [""] * n_full)
        shares = share_keys(chains, namespace, self.part_bytes)

        def encode(index: int) -> EncodedBlock:
            return encode_block(cache.blocks[index], self.spec, self.quantization, self.group_size)

        done = self._store_prefix(shares, encode, prefix_times(time.time(), len(shares)))
        self._stats.add("prefix_puts")
        self._stats.add("prefix_blocks_held", done.held)
        self._stats.add("prefix_blocks_written", done.written)
        self._stats.add("prefix_bytes_written", done.bytes_written)
        self._after_prefix_put(done.bytes_written)
        return True

    def _store_prefix(
        self, shares: Sequence[str], encode: Callable[[int], EncodedBlock], when: Sequence[float]
    ) -> PrefixWrite:
        """Hold the shared block of each share key, recording `when[i]` as block i's last use: a stored
        version is held as it is (a lookup, no encode), the others are `encode(i)`d and written by the
        hold. A block collected before the hold is written again, and a hold that lost a race is tried
        again, until the race budget is spent (store/backend.py `race_attempts`)."""
        new: dict[int, EncodedBlock] = {}  # blocks this put encodes
        send: set[int] = set()  # of those, the ones the next hold writes
        written: set[int] = set()
        for _attempt in race_attempts():
            looked_up = [i for i in range(len(shares)) if i not in new]
            versions = dict(zip(looked_up, self._find_versions([shares[i] for i in looked_up]), strict=True))
            blocks: list[tuple[str, int, int]] = []  # (name, nbytes, crc) of each share key
            for index, share in enumerate(shares):
                version = versions.get(index)
                if version is None:
                    if index not in new:
                        new[index] = encode(index)
                        send.add(index)
                    version = (shared_name(share, new[index].crc32), new[index].nbytes, new[index].crc32)
                blocks.append(version)
            attempt = self._hold_blocks(PrefixHold(blocks, new, send, when))
            written.update(attempt.written)
            send = set(attempt.missing)
            for index in send - set(new):
                new[index] = encode(index)
            if not send and not attempt.lost_race:
                nbytes = sum(new[i].nbytes for i in written)
                held = len(shares) - len(written)
                return PrefixWrite(held=held, written=len(written), bytes_written=nbytes)
        raise StoreError(f"put_prefix of {len(shares)} blocks kept losing races with other writers")

    @abstractmethod
    def _find_versions(self, shares: Sequence[str]) -> Iterable[tuple[str, int, int] | None]:
        """(name, nbytes, crc32) of each share key's stored version, None where there is none
        (lazily where lookups are one by one: the caller may stop at the first None). A primitive:
        the shared index is a directory listing on disk, a pointer key in Redis."""

    @abstractmethod
    def _hold_blocks(self, hold: PrefixHold) -> HoldAttempt:
        """Hold every block of `hold` for prefixes, recording `when[i]` as its last use, writing the
        blocks `send` names first. A primitive: its atomic step is a hard link that never replaces on
        disk, a WATCHed MULTI/EXEC over every block's values in Redis."""

    @abstractmethod
    def _touch_prefix(self, blocks: Sequence[tuple[str, int]], when: Sequence[float]) -> None:
        """Record `when[i]` as the last use of each (name, bytes) block, a run from the start (where
        the prefix budget holds them). A primitive: the holds' mtimes on disk, their scores and TTLs
        in Redis."""

    @abstractmethod
    def _prefix_entries(self) -> list[PrefixEntry]:
        """Every block held for anonymous prefixes, with how many agents link it (read together: a
        directory scan with link counts on disk, one pipeline in Redis)."""

    def _evict_prefix(self, entry: PrefixEntry) -> bool:
        """Drop the prefix hold on a block and delete it unless an agent links it (checked at that
        moment); False if it was kept or already gone. An agent that links it between the check and
        the drop keeps it: `_drop_hold` deletes the block only if its reference count is then 0."""
        if parse_shared_name(entry.name) is None:
            return False
        if self._shared_users(entry.name) > 0:
            return False  # an agent links it: the agents' budget decides
        return self._drop_hold(entry)

    @abstractmethod
    def _shared_users(self, name: str) -> int:
        """The reference count of a shared block: how many agents' manifests link it (neither the
        prefix hold nor the index of shared blocks counts). A primitive: hard-link counts on disk, a
        reference set in Redis."""

    @abstractmethod
    def _drop_hold(self, entry: PrefixEntry) -> bool:
        """Drop the prefix hold on a block and delete it if then no agent links it, atomically; False
        if there was no hold. A primitive: an unlink (a racing agent keeps its own link) on disk, the
        release script (or its WATCH fallback) in Redis."""

    def _drop_damaged_prefix(self, ref: BlockRef) -> None:
        """A shared block that failed its checks: drop it if only the prefix budget holds it, so the
        next put_prefix writes it again (agents that link it find it damaged themselves)."""
        try:
            self._evict_prefix(PrefixEntry(ref.name, ref.nbytes, 0.0, 0, self.part_bytes))
        except self._io_errors() as exc:
            log.warning("%s: could not drop the damaged shared block %s: %r", self.kind, ref.name, exc)

    def _after_prefix_put(self, nbytes: int) -> None:
        """Evict prefix blocks if they may be over budget (else a full scan at most every few seconds)."""
        self._prefix_estimate += nbytes
        stale = time.monotonic() - self._prefix_last_scan > BUDGET_RESCAN_S
        if stale or self._prefix_estimate > self.prefix_max_bytes:
            self.enforce_prefix_budget()

    def enforce_prefix_budget(self) -> int:
        """Evict held prefix blocks that no agent links, least recently used first, until those fit
        prefix_max_bytes. Returns how many were evicted."""
        entries = sorted((e for e in self._prefix_entries() if e.agents == 0), key=lambda e: e.last_used)
        total = sum(entry.nbytes for entry in entries)
        evicted = 0
        for entry in entries:
            if total <= self.prefix_max_bytes:
                break
            if self._evict_prefix(entry):
                evicted += 1
                self._stats.add("prefix_evictions")
                self._stats.add("prefix_evicted_bytes", entry.nbytes)
            total -= entry.nbytes  # evicted, or linked by an agent meanwhile: out of this budget either way
        if evicted:
            log.info(
                "%s: evicted %d prefix blocks to stay under %d bytes",
                self.kind,
                evicted,
                self.prefix_max_bytes,
            )
        self._prefix_estimate = total
        self._prefix_last_scan = time.monotonic()
        return evicted
