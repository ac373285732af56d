"""RedisStore: agent caches as binary Redis values, so any worker sharing the Redis can resume.

Keys, all under one prefix (default `kvrq:cache:`), `<key>` a hash of the agent id:

    <prefix><key>:m              the manifest (safetensors)
    <prefix><key>:b:<name>       one block (safetensors)
    <prefix>index                sorted set: agent id -> last used (unix time)
    <prefix>sizes                hash: agent id -> bytes stored

A put writes its new blocks first (pipelined, each with a provisional expiry so a
crashed writer leaves nothing behind for long), then in one MULTI/EXEC guarded by
WATCH on the manifest key: swaps in the manifest, makes the new blocks permanent
(or gives them the agent TTL), deletes the blocks only the replaced manifest used,
and updates index and sizes. If another writer swapped the manifest meanwhile the
transaction aborts and the put commits again (re-planned only if blocks it reused are
gone): last writer wins, never a mix.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import random
import time
import zlib
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from typing import Any

import redis
from redis.exceptions import DataError, RedisError, WatchError

from engine.blocks import AgentCache
from engine.spec import ModelCacheSpec
from store.agent_ids import agent_key, validate_agent_id
from store.backend import Blob, BlockBackend, Usage, WritePlan, check_fence
from store.base import CacheInfo
from store.errors import BadCacheError, StoreError
from store.iopool import submit
from store.manifest import (
    BlockRef,
    Manifest,
    decode_manifest,
    encode_manifest,
    stored_fence,
    summarize_manifest,
)
from store.resp import ScatterPacker, ScatterValue

DEFAULT_PREFIX = "kvrq:cache:"
PENDING_TTL_MS = 3_600_000  # an uncommitted block disappears after an hour
_PUT_ATTEMPTS = 8
SOCKET_CONNECT_TIMEOUT_S = 5.0
SOCKET_TIMEOUT_S = 60.0  # per socket operation, not per command: large values still fit
_PIPELINE_BYTES = 64 * 1024 * 1024  # flush a block-writing pipeline every ~64 MB


class RedisStore(BlockBackend):
    kind = "redis"

    def __init__(
        self,
        url: str | redis.Redis,
        spec: ModelCacheSpec,
        *,
        quantization: str = "none",
        group_size: int = 64,
        max_bytes: int | None = None,
        ttl_s: int | None = None,
        prefix: str = DEFAULT_PREFIX,
    ) -> None:
        super().__init__(spec, quantization=quantization, group_size=group_size, max_bytes=max_bytes)
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.ttl_s = ttl_s
        self.prefix = prefix
        if isinstance(url, str):
            # Timeouts (overridable in the URL) so a hung server cannot hang a worker's shutdown flush.
            pool = redis.ConnectionPool.from_url(
                url,
                command_packer=ScatterPacker(),
                socket_connect_timeout=SOCKET_CONNECT_TIMEOUT_S,
                socket_timeout=SOCKET_TIMEOUT_S,
            )
            self._client = redis.Redis(connection_pool=pool)
            self._scatter = True
            self._owns_client = True
        else:
            self._client = url  # e.g. a fakeredis client in tests: values are joined before sending
            self._scatter = False
            self._owns_client = False
        self._index = f"{prefix}index"
        self._sizes = f"{prefix}sizes"

    # --- keys ----------------------------------------------------------------------------------
    def _mkey(self, agent_id: str) -> str:
        return f"{self.prefix}{agent_key(agent_id)}:m"

    def _bkey(self, agent_id: str, name: str) -> str:
        return f"{self.prefix}{agent_key(agent_id)}:b:{name}"

    def _backend_errors(self) -> tuple[type[Exception], ...]:
        return (RedisError,)

    # --- raw reads -----------------------------------------------------------------------------
    def _read_manifest(self, agent_id: str) -> Blob | None:
        value = self._client.get(self._mkey(agent_id))
        return _as_blob(value)

    def _fetch_blocks(self, agent_id: str, refs: Sequence[BlockRef]) -> list[tuple[Blob, int] | None]:
        """GET the blocks in pipelined chunks; each chunk's CRCs run on helper threads while
        the next chunk arrives."""
        pending: list[tuple[Blob | None, Future[int] | None]] = []
        for chunk in _chunks(refs, _PIPELINE_BYTES // 2):
            pipe = self._client.pipeline(transaction=False)
            for ref in chunk:
                pipe.get(self._bkey(agent_id, ref.name))
            for value in pipe.execute():
                blob = _as_blob(value)
                pending.append((blob, None if blob is None else submit(zlib.crc32, blob)))
        return [None if blob is None or crc is None else (blob, crc.result()) for blob, crc in pending]

    def _touch(self, agent_id: str, manifest: Manifest) -> None:
        pipe = self._client.pipeline(transaction=False)
        pipe.zadd(self._index, {agent_id: time.time()}, xx=True)
        if self.ttl_s is not None:  # sliding expiry: the whole cache lives ttl_s past its last use
            pipe.expire(self._mkey(agent_id), self.ttl_s)
            for ref in manifest.blocks:
                pipe.expire(self._bkey(agent_id, ref.name), self.ttl_s)
        pipe.execute()

    # --- writes --------------------------------------------------------------------------------
    def put(self, agent_id: str, cache: AgentCache, *, fence: int | None = None) -> bool:
        validate_agent_id(agent_id)
        check_fence(fence)
        cache.validate(self.spec)
        mkey = self._mkey(agent_id)
        plan: WritePlan | None = None
        for attempt in range(_PUT_ATTEMPTS):
            if attempt:
                self._stats.add("put_retries")
                time.sleep(random.uniform(0, 0.002 * attempt))
            with self._client.pipeline(transaction=True) as tx:
                tx.watch(mkey)
                current = _as_blob(tx.get(mkey))
                # Compared under WATCH: a writer that swaps the manifest in meanwhile aborts our EXEC.
                new_fence = self._fence_for(agent_id, fence, stored_fence(current))
                if new_fence is None:
                    if plan is not None:
                        self._discard(agent_id, plan)
                    return False
                if plan is None or not self._blocks_exist(tx, agent_id, plan.kept_names):
                    # (Re)plan; a retry whose kept blocks still exist only needs the commit again.
                    if plan is not None:
                        self._discard(agent_id, plan)
                    plan = self.plan_write(agent_id, cache, self._reusable(tx, agent_id, current))
                    self._write_blocks(agent_id, plan)  # removes what it wrote if it fails
                manifest = dataclasses.replace(plan.manifest(), fence=new_fence)
                manifest_blob = encode_manifest(manifest)
                try:
                    self._commit(tx, agent_id, plan, manifest, manifest_blob, self._names_in(current))
                except WatchError:
                    continue
            self._count_put(plan, len(manifest_blob))
            self._after_put(agent_id, manifest.block_bytes + len(manifest_blob))
            return True
        if plan is not None:
            self._discard(agent_id, plan)
        raise StoreError(f"put of agent {agent_id!r} lost {_PUT_ATTEMPTS} races with other writers")

    @staticmethod
    def _names_in(blob: Blob | None) -> builtins.list[str]:
        """Names of the blocks a manifest uses (whatever spec wrote it), [] if unreadable."""
        if blob is None:
            return []
        try:
            return list(summarize_manifest(blob).block_names)
        except BadCacheError:
            return []

    def _reusable(self, tx: Any, agent_id: str, blob: Blob | None) -> Manifest | None:
        """The current manifest if it is ours to build on and all its blocks are still there."""
        if blob is None:
            return None
        try:
            previous = decode_manifest(blob, agent_id, self.spec)
        except BadCacheError:
            return None
        names = [ref.name for ref in previous.blocks]
        return previous if self._blocks_exist(tx, agent_id, names) else None

    def _blocks_exist(self, tx: Any, agent_id: str, names: Sequence[str]) -> bool:
        """Whether all these blocks exist; under WATCH they then survive until EXEC (only
        commits, which touch the watched manifest, delete committed blocks)."""
        keys = [self._bkey(agent_id, name) for name in names]
        return not keys or tx.exists(*keys) == len(keys)

    def _value(self, parts: Sequence[bytes | memoryview]) -> Any:
        """What redis-py is handed as a value (a ScatterValue only reaches our own packer)."""
        return ScatterValue(parts) if self._scatter else b"".join(parts)

    def _write_blocks(self, agent_id: str, plan: WritePlan) -> None:
        """SET the new blocks on their provisional expiry; on failure (Redis full, connection lost)
        remove what was written, best effort: the provisional expiry covers the rest."""
        try:
            pipe = self._client.pipeline(transaction=False)
            queued = 0
            for block in plan.new_blocks:
                key = self._bkey(agent_id, block.name)
                pipe.set(key, self._value(block.encoded.parts()), px=PENDING_TTL_MS)
                queued += block.encoded.nbytes
                if queued >= _PIPELINE_BYTES:
                    pipe.execute()
                    queued = 0
            pipe.execute()
        except RedisError:
            with contextlib.suppress(RedisError):
                self._discard(agent_id, plan)
            raise

    def _commit(
        self,
        tx: Any,
        agent_id: str,
        plan: WritePlan,
        manifest: Manifest,
        manifest_blob: bytes,
        old: Sequence[str],
    ) -> None:
        """One MULTI/EXEC: swap the manifest, settle block expiries, drop replaced blocks, index."""
        new_names = {ref.name for ref in manifest.blocks}
        written = {block.name for block in plan.new_blocks}
        tx.multi()
        tx.set(self._mkey(agent_id), manifest_blob, ex=self.ttl_s)
        for ref in manifest.blocks:
            key = self._bkey(agent_id, ref.name)
            if self.ttl_s is not None:
                tx.expire(key, self.ttl_s)
            elif ref.name in written:
                tx.persist(key)
        stale = [self._bkey(agent_id, name) for name in old if name not in new_names]
        if stale:
            tx.unlink(*stale)
        tx.zadd(self._index, {agent_id: time.time()})
        tx.hset(self._sizes, agent_id, manifest.block_bytes + len(manifest_blob))
        tx.execute()

    def _discard(self, agent_id: str, plan: WritePlan) -> None:
        keys = [self._bkey(agent_id, block.name) for block in plan.new_blocks]
        if keys:
            self._client.unlink(*keys)

    # --- delete, list, info, budgets -----------------------------------------------------------
    def delete(self, agent_id: str) -> bool:
        existed = self._remove(validate_agent_id(agent_id))
        if existed:
            self._stats.add("deletes")
        return existed

    def _remove_if_manifest_is(self, agent_id: str, manifest_blob: bytes) -> bool:
        return self._remove(agent_id, only_if=manifest_blob)

    def _remove(self, handle: str, only_if: bytes | None = None) -> bool:
        """Delete the agent (if `only_if` is given: only while its manifest holds those bytes)."""
        mkey = self._mkey(handle)
        for _attempt in range(_PUT_ATTEMPTS):
            with self._client.pipeline(transaction=True) as tx:
                tx.watch(mkey)
                blob = _as_blob(tx.get(mkey))
                if only_if is not None and (blob is None or bytes(blob) != only_if):
                    return False
                names: builtins.list[str] = []
                if blob is not None:
                    try:
                        names = list(summarize_manifest(blob).block_names)
                    except BadCacheError:
                        names = []
                tx.multi()
                tx.unlink(mkey, *(self._bkey(handle, name) for name in names))
                tx.zrem(self._index, handle)
                tx.hdel(self._sizes, handle)
                try:
                    tx.execute()
                except WatchError:
                    continue
            if blob is not None and not names:
                self._sweep(handle)  # damaged manifest: find the agent's permanent blocks by pattern
            return blob is not None
        raise StoreError(f"delete of agent {handle!r} lost {_PUT_ATTEMPTS} races with other writers")

    def _sweep(self, agent_id: str) -> None:
        """Delete an agent's committed blocks (no pending expiry) when no manifest can list them."""
        pattern = f"{self.prefix}{agent_key(agent_id)}:b:*"
        for key in self._client.scan_iter(match=pattern, count=1000):
            if self._client.pttl(key) == -1:
                self._client.unlink(key)

    def list(self) -> builtins.list[str]:
        return sorted(entry.handle for entry in self._usage())

    def info(self, agent_id: str) -> CacheInfo | None:
        blob = _as_blob(self._client.get(self._mkey(validate_agent_id(agent_id))))
        if blob is None:
            return None
        try:
            summary = summarize_manifest(blob)
        except BadCacheError:
            return None
        if summary.agent_id != agent_id:
            return None
        score = self._client.zscore(self._index, agent_id)
        return CacheInfo(
            agent_id=agent_id,
            n_tokens=summary.n_tokens,
            nbytes=summary.block_bytes + len(blob),
            last_used=float(score) if score is not None else 0.0,
            quantization=summary.quantization,
            n_blocks=summary.n_blocks,
        )

    def _usage(self) -> builtins.list[Usage]:
        """Indexed agents whose manifest still exists; entries of expired ones are dropped here."""
        members: Any = self._client.zrange(self._index, 0, -1, withscores=True)
        if not members:
            return []
        ids = [member.decode() if isinstance(member, bytes) else str(member) for member, _ in members]
        pipe = self._client.pipeline(transaction=False)
        for agent_id in ids:
            pipe.exists(self._mkey(agent_id))
        pipe.hmget(self._sizes, ids)
        *exists, sizes = pipe.execute()
        usage, gone = [], []
        for agent_id, (_member, score), present, size in zip(ids, members, exists, sizes, strict=True):
            if present:
                usage.append(Usage(agent_id, agent_id, int(size or 0), float(score)))
            else:
                gone.append(agent_id)
        if gone:
            pipe = self._client.pipeline(transaction=False)
            pipe.zrem(self._index, *gone)
            pipe.hdel(self._sizes, *gone)
            pipe.execute()
        return usage

    def close(self) -> None:
        if self._owns_client:
            self._client.close()


def _chunks(refs: Sequence[BlockRef], max_bytes: int) -> Iterator[Sequence[BlockRef]]:
    start, size = 0, 0
    for index, ref in enumerate(refs):
        size += ref.nbytes
        if size >= max_bytes:
            yield refs[start : index + 1]
            start, size = index + 1, 0
    if start < len(refs):
        yield refs[start:]


def _as_blob(value: object) -> Blob | None:
    """A GET reply as a blob (the client never decodes replies, so it is bytes or None)."""
    if value is None or isinstance(value, bytes | bytearray | memoryview):
        return value
    raise DataError(f"Redis returned a {type(value).__name__}, not bytes")
