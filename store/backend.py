"""What DiskStore and RedisStore share: the read path, write planning, and budget eviction.

A backend only supplies raw reads and writes of manifests and blocks. Reading is
lock-free: a reader that finds a block gone re-reads the manifest, and if a newer
generation replaced it meanwhile it simply reads again; only if the same manifest
still points at a missing block is the cache broken.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.blocks import AgentCache
from engine.spec import ModelCacheSpec
from store import quant
from store.agent_ids import validate_agent_id
from store.base import BACKEND_COUNTERS, CacheInfo, Stats, log, record_miss, shared_prefix
from store.block_codec import EncodedBlock, decode_block, encode_block
from store.errors import ABSENT, BACKEND_ERROR, MISSING_BLOCK, NO_COMMON_PREFIX, BadCacheError
from store.manifest import BlockRef, Manifest, block_name, chain_keys, decode_manifest, new_generation

_READ_ATTEMPTS = 3

Blob = bytes | bytearray | memoryview


@dataclass(frozen=True)
class WritePlan:
    """A put worked out against the previous manifest: which blocks to write, which to keep."""

    manifest: Manifest
    new_blocks: list[tuple[BlockRef, EncodedBlock]]
    reused: int


class BlockBackend(ABC):
    """Base of the block-structured backends (one manifest + one blob per block per agent)."""

    kind = "backend"

    def __init__(
        self,
        spec: ModelCacheSpec,
        *,
        quantization: str = "none",
        group_size: int = 64,
        max_bytes: int | None = None,
    ) -> None:
        quant.check_quantization(quantization, group_size, (spec.k_head_dim, spec.v_head_dim))
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.spec = spec
        self.quantization = quantization
        self.group_size = group_size if quantization != "none" else 0
        self.max_bytes = max_bytes
        self._stats = Stats(BACKEND_COUNTERS)

    # --- raw storage, supplied by each backend -------------------------------------------------
    @abstractmethod
    def _read_manifest(self, agent_id: str) -> Blob | None: ...

    @abstractmethod
    def _read_blocks(self, agent_id: str, refs: Sequence[BlockRef]) -> list[Blob | None]:
        """The blobs of `refs` in order; None for a block that is not there."""

    @abstractmethod
    def _touch(self, agent_id: str) -> None:
        """Record that the agent was just used (for LRU eviction and `info`)."""

    # --- reads ---------------------------------------------------------------------------------
    def get(self, agent_id: str, *, prompt_tokens: Sequence[int] | None = None) -> AgentCache | None:
        validate_agent_id(agent_id)
        self._stats.add("gets")
        try:
            cache = self._load(agent_id, prompt_tokens)
        except BadCacheError as exc:
            record_miss(self._stats, self.kind, agent_id, exc.reason, exc.detail)
            return None
        except (OSError, self._backend_errors()) as exc:
            record_miss(self._stats, self.kind, agent_id, BACKEND_ERROR, repr(exc))
            return None
        self._stats.add("hits")
        return cache

    def _backend_errors(self) -> tuple[type[BaseException], ...]:
        return ()

    def _load(self, agent_id: str, prompt_tokens: Sequence[int] | None) -> AgentCache:
        for _attempt in range(_READ_ATTEMPTS):
            blob = self._read_manifest(agent_id)
            if blob is None:
                raise BadCacheError(ABSENT, "no cache stored")
            manifest = decode_manifest(blob, agent_id, self.spec)
            n_tokens = shared_prefix(manifest.token_ids, prompt_tokens)
            if n_tokens == 0 and manifest.n_tokens > 0:
                raise BadCacheError(NO_COMMON_PREFIX, "the prompt shares no token with the cache")
            refs = manifest.blocks[: self.spec.blocks_for(n_tokens)]
            blobs = self._read_blocks(agent_id, refs)
            if any(b is None for b in blobs):
                if self._manifest_generation(agent_id) != manifest.generation:
                    continue  # rewritten while we read: read the new one
                missing = next(ref.name for ref, b in zip(refs, blobs) if b is None)
                raise BadCacheError(MISSING_BLOCK, f"block {missing} is gone")
            blocks = [decode_block(b, ref, manifest) for b, ref in zip(blobs, refs) if b is not None]
            self._stats.add("bytes_read", len(blob) + sum(ref.nbytes for ref in refs))
            covered = sum(ref.n_tokens for ref in refs)
            cache = AgentCache(self.spec, manifest.token_ids[:covered].tolist(), blocks)
            if n_tokens < covered:
                cache = cache.truncated(n_tokens)
            self._touch(agent_id)
            return cache
        raise BadCacheError(MISSING_BLOCK, f"cache kept changing during {_READ_ATTEMPTS} reads")

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

    # --- writes --------------------------------------------------------------------------------
    def plan_write(self, agent_id: str, cache: AgentCache, previous: Manifest | None) -> WritePlan:
        """Encode the blocks `previous` does not already hold; keep (by reference) those it does."""
        cache.validate(self.spec)
        generation = new_generation()
        chains = chain_keys(self.spec, self.quantization, self.group_size, cache.token_ids)
        reusable: dict[tuple[str, int], BlockRef] = {}
        if previous is not None and (previous.quantization, previous.group_size) == (
            self.quantization,
            self.group_size,
        ):
            reusable = {(ref.chain, ref.n_tokens): ref for ref in previous.blocks}
        refs: list[BlockRef] = []
        new_blocks: list[tuple[BlockRef, EncodedBlock]] = []
        for block, chain in zip(cache.blocks, chains):
            kept = reusable.get((chain, block.n_tokens))
            if kept is not None:
                refs.append(kept)
                continue
            encoded = encode_block(block, self.spec, self.quantization, self.group_size)
            ref = BlockRef(block_name(chain, generation), chain, block.n_tokens, encoded.nbytes, encoded.crc32)
            refs.append(ref)
            new_blocks.append((ref, encoded))
        manifest = Manifest(
            agent_id=agent_id,
            spec=self.spec,
            quantization=self.quantization,
            group_size=self.group_size,
            token_ids=np.asarray(cache.token_ids, dtype=np.int64),
            blocks=tuple(refs),
            generation=generation,
            created=time.time(),
        )
        return WritePlan(manifest, new_blocks, len(refs) - len(new_blocks))

    def _count_put(self, plan: WritePlan, manifest_bytes: int) -> None:
        self._stats.add("puts")
        self._stats.add("blocks_written", len(plan.new_blocks))
        self._stats.add("blocks_reused", plan.reused)
        self._stats.add("bytes_written", manifest_bytes + sum(e.nbytes for _, e in plan.new_blocks))

    # --- budgets -------------------------------------------------------------------------------
    @abstractmethod
    def _usage(self) -> list[CacheInfo]:
        """Every stored agent's info (for budget enforcement)."""

    def delete(self, agent_id: str) -> bool:
        raise NotImplementedError

    def enforce_budget(self, keep: str | None = None) -> int:
        """Evict least-recently-used agents (never `keep`) until the store fits max_bytes."""
        if self.max_bytes is None:
            return 0
        infos = sorted(self._usage(), key=lambda info: info.last_used)
        total = sum(info.nbytes for info in infos)
        evicted = 0
        for info in infos:
            if total <= self.max_bytes:
                break
            if info.agent_id == keep:
                continue
            if self.delete(info.agent_id):
                evicted += 1
                total -= info.nbytes
                self._stats.add("evictions")
                self._stats.add("evicted_bytes", info.nbytes)
                log.info(
                    "%s: evicted agent %r (%d bytes, last used %.0f s ago) to stay under %d bytes",
                    self.kind,
                    info.agent_id,
                    info.nbytes,
                    time.time() - info.last_used,
                    self.max_bytes,
                )
        return evicted

    def stats(self) -> dict[str, int]:
        return self._stats.snapshot()
