"""RedisStore: agent caches as binary Redis values, so any worker sharing the Redis can resume.

Keys, all under one prefix (default `kvrq:cache:`), `<key>` a hash of the agent id:

    <prefix><key>:m              the manifest (safetensors)
    <prefix><key>:b:<name>       one block (safetensors), or its first 4 MB when it is larger:
    <prefix><key>:b:<name>:<i>   the block's next 4 MB ranges (i = 1, 2, ...)
    <prefix>index                sorted set: agent id -> last used (unix time)
    <prefix>sizes                hash: agent id -> bytes of its own (manifest, blocks no other agent uses)
    <prefix>links                hash: agent id -> the shared blocks it uses, "<name>:<bytes>,..."
    <prefix>pinned               set: pinned agent ids (no budget eviction; with a TTL, their keys
                                 and those of the shared blocks they use are kept without expiry)
    <prefix>prefixes             sorted set: shared block held for anonymous prefixes -> last used
    <prefix>prefix-sizes         hash: such a block -> "<nbytes>:<part_bytes>"

A put writes its new blocks first (pipelined, each with a provisional expiry so a
crashed writer leaves nothing behind for long), then in one MULTI/EXEC guarded by
WATCH on the manifest key: swaps in the manifest, makes the new blocks permanent
(or gives them the agent TTL), deletes the blocks only the replaced manifest used,
and updates index, sizes and links. If another writer swapped the manifest meanwhile the
transaction aborts and the put commits again (re-planned only if blocks it reused are
gone), after a random pause, for up to RACE_BUDGET_S: last writer wins, never a mix.
Reads pipeline GETs and receive each value straight into the block's buffer (store/redis_reads.py
over store/resp.py), checksumming blocks as they complete.

Why one class of ~470 lines: it is the primitives store/policy.py lists, over one client, each a
pipeline or a MULTI/EXEC whose keys have to be named together in one place to be atomic; everything
that is not a primitive lives beside it (redis_keys.py the layout, redis_pins.py pins and TTLs,
redis_shared.py the reference sets and their Lua collector, redis_reads.py the reads, replication.py
the WAIT after a put).
"""

from __future__ import annotations

import builtins
import contextlib
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import redis
from redis.exceptions import RedisError, WatchError

from engine.core.blocks import AgentCache
from engine.core.spec import ModelCacheSpec
from producer.wire.redis_url import FAILOVER_BUDGET_S, REDIS_DOWN
from producer.wire.text import as_text
from store.agent_ids import agent_key
from store.backend import BackendOptions, Blob
from store.base import log
from store.block_codec import EncodedBlock
from store.budget import Usage, split_shared
from store.commit import NewBlock, WritePlan, WritingBackend
from store.errors import BadCacheError, StoreError
from store.manifest import (
    BlockRef,
    Manifest,
    parse_shared_name,
    stored_fence,
    summarize_manifest,
)
from store.prefix_holds import HoldAttempt, PrefixEntry, PrefixHold
from store.redis_keys import (
    RedisKeys,
    as_blob,
    links_value,
    parse_links,
    parse_pointer,
    share_of,
    split_parts,
)
from store.redis_pins import PinnedKeys
from store.redis_reads import fetch_into_place, fetch_with_client
from store.redis_shared import SharedBlocks
from store.replication import (
    UNREPLICATED_HOLD_S,
    Replication,
    backoff,
    confirm,
)
from store.resp import ScatterPacker, ScatterValue

if TYPE_CHECKING:
    from typing_extensions import Unpack

DEFAULT_PREFIX = "kvrq:cache:"
#: Makes a client for a Redis URL, given redis-py pool options (the URL's own options win).
Connect = Callable[..., redis.Redis]
PENDING_TTL_MS = 3_600_000  # an uncommitted block disappears after an hour
SOCKET_CONNECT_TIMEOUT_S = 5.0
SOCKET_TIMEOUT_S = 60.0  # per socket operation, not per command: large values still fit
_PIPELINE_BYTES = 64 * 1024 * 1024  # flush a block-writing pipeline every ~64 MB
# Blocks are stored as values of at most 4 MB: a large value holds Redis's single thread (and every other
# client) for its whole copy, and replication and client buffers handle many moderate values better.
MAX_VALUE_BYTES = 4_000_000


class RedisStore(WritingBackend):
    kind = "redis"
    ttl_s: int | None  # EXPIRE takes whole seconds

    def __init__(
        self,
        url: str | redis.Redis,
        spec: ModelCacheSpec,
        *,
        ttl_s: int | None = None,
        prefix: str = DEFAULT_PREFIX,
        value_bytes: int = MAX_VALUE_BYTES,
        connect: Connect | None = None,
        **options: Unpack[BackendOptions],
    ) -> None:
        """`connect(url, **pool_options)` makes the client for a URL (the worker passes producer's,
        which knows Sentinel URLs); without it, redis-py's `from_url` forms only."""
        super().__init__(spec, ttl_s=ttl_s, **options)
        if value_bytes < 1024:
            raise ValueError(f"value_bytes must be at least 1024, got {value_bytes}")
        self.part_bytes = value_bytes
        self.prefix = prefix
        if isinstance(url, str):
            # Timeouts (overridable in the URL) so a hung server cannot hang a worker's shutdown flush.
            pool: dict[str, Any] = {
                "command_packer": ScatterPacker(),
                "socket_connect_timeout": SOCKET_CONNECT_TIMEOUT_S,
                "socket_timeout": SOCKET_TIMEOUT_S,
            }
            if connect is not None:
                self._client = connect(url, **pool)
            else:
                self._client = redis.Redis(connection_pool=redis.ConnectionPool.from_url(url, **pool))
            self._scatter = True
            self._owns_client = True
        else:
            self._client = url  # e.g. a fakeredis client in tests: values are joined before sending
            self._scatter = False
            self._owns_client = False
        self.keys = RedisKeys(prefix)
        self.shared_blocks = SharedBlocks(self._client, self.keys, self._stats, ttl_s)
        self.pins = PinnedKeys(self._client, self.keys, ttl_s)
        self.failover_budget_s = FAILOVER_BUDGET_S  # how long a replicated put rides a failover
        self._failing = False  # the last replicated put spent its budget: one try each until one succeeds
        self._unreplicated_until = 0.0  # monotonic: until then puts skip the replicas' confirmation

    def _mkey(self, agent_id: str) -> str:
        """The agent's manifest key (tests/fleet reach it by this name)."""
        return self.keys.manifest(agent_id)

    def _backend_errors(self) -> tuple[type[Exception], ...]:
        return (RedisError,)

    # --- raw reads -----------------------------------------------------------------------------
    def _read_manifest(self, agent_id: str) -> Blob | None:
        value = self._client.get(self.keys.manifest(agent_id))
        return as_blob(value)

    def _fetch_blocks(
        self, agent_id: str | None, manifest: Manifest, refs: Sequence[BlockRef]
    ) -> builtins.list[tuple[Blob, int] | None]:
        """Shared blocks' keys name no agent (RedisKeys.parts), so `agent_id` None reads them alike."""
        agent_id = agent_id or ""
        if self._scatter:
            return fetch_into_place(self._client.connection_pool, self.keys, agent_id, manifest, refs)
        return fetch_with_client(self._client, self.keys, agent_id, manifest, refs, _PIPELINE_BYTES // 2)

    # --- pins and TTLs (store/redis_pins.py) ----------------------------------------------------
    def _touch(self, agent_id: str, manifest: Manifest) -> None:
        self.pins.touch(agent_id, manifest)

    def _set_pinned(self, agent_id: str, pinned: bool) -> bool:
        return self.pins.pin(agent_id) if pinned else self.pins.unpin(agent_id)

    # --- writes --------------------------------------------------------------------------------
    def _write(self, agent_id: str, cache: AgentCache, fence: int | None, namespace: str) -> bool:
        replication = Replication.of(self._client)
        if replication.replicas <= 0:
            return self._put(agent_id, cache, fence, namespace) is not None
        return self._put_replicated(agent_id, cache, fence, namespace, replication)

    def _put_replicated(
        self, agent_id: str, cache: AgentCache, fence: int | None, namespace: str, replication: Replication
    ) -> bool:
        """`_put`, confirmed on the replicas and read back (store/replication.py says why).

        A commit gone by then (a failover dropped it) is written again. Refused writes and lost
        connections are retried for the failover budget, then raise StoreError (the worker counts a
        failed put). A primary that answers but that no replica confirms twice (one without replicas
        since a failover, where `min-replicas-to-write` is off) keeps the put, counted unconfirmed, and
        the puts of the next UNREPLICATED_HOLD_S skip the confirmation: a shard without a replica stays
        writable. After a put spent its budget, the next ones get one try each until one succeeds.
        """
        if time.monotonic() < self._unreplicated_until:
            self._stats.add("puts_unconfirmed")
            return self._put(agent_id, cache, fence, namespace) is not None
        mkey = self.keys.manifest(agent_id)
        written: bytes | None = None
        failure, unconfirmed = "no try", 0
        budget = 0.0 if self._failing else self.failover_budget_s
        for pause in backoff(budget):
            time.sleep(pause)
            try:
                if written is None:
                    written = self._put(agent_id, cache, fence, namespace)
                    if written is None:
                        return False  # stale: a later turn's cache is stored
                found = confirm(self._client, mkey, self.keys.replication_mark, replication)
            except REDIS_DOWN as exc:
                failure = f"{type(exc).__name__}: {exc}"
                continue
            self._failing = False
            if found.value != written:
                if fence is not None and found.value is not None and stored_fence(found.value) > fence:
                    return True  # a later turn replaced ours after it was stored
                self._stats.add("puts_rewritten")
                log.warning("redis: agent %r's commit was gone when read back: writing it again", agent_id)
                written, failure = None, "the commit was lost (a failover?)"
            elif found.replicas >= replication.replicas:
                return True
            else:
                unconfirmed += 1
                failure = f"{found.replicas} of {replication.replicas} replica(s) confirmed it"
                if unconfirmed >= 2:
                    self._unreplicated_until = time.monotonic() + UNREPLICATED_HOLD_S
                    self._stats.add("puts_unconfirmed")
                    log.warning(
                        "redis: no replica confirmed agent %r's put (%s): kept unconfirmed, and puts "
                        "skip the confirmation for %.0f s",
                        agent_id,
                        failure,
                        UNREPLICATED_HOLD_S,
                    )
                    return True
        self._failing = True
        raise StoreError(f"put of agent {agent_id!r} not confirmed on the replicas in time ({failure})")

    def _put(self, agent_id: str, cache: AgentCache, fence: int | None, namespace: str) -> bytes | None:
        """One commit of the put, as `_put_replicated` retries it (tests/fleet replace it to lose one)."""
        return self._commit_put(agent_id, cache, fence, namespace)

    # --- the compare-and-swap (WritingBackend._commit_put, BlockStore._remove): a WATCH on the manifest
    @contextlib.contextmanager
    def _manifest_guard(self, handle: str) -> Iterator[tuple[Any, Blob | None]]:
        """A transaction pipeline with a WATCH on the manifest key, and the manifest read under it."""
        with self._client.pipeline(transaction=True) as tx:
            tx.watch(self.keys.manifest(handle))
            yield tx, as_blob(tx.get(self.keys.manifest(handle)))

    def _stored_blocks(
        self, agent_id: str, blob: Blob | None
    ) -> tuple[builtins.list[str], builtins.list[BlockRef], int]:
        """What a manifest (whatever spec wrote it) uses: the keys of the agent's own blocks, its
        shared blocks and their part size; nothing if it is unreadable."""
        if blob is None:
            return [], [], 0
        try:
            summary = summarize_manifest(blob)
        except BadCacheError:
            return [], [], 0
        own = [
            key
            for name, nbytes in summary.blocks
            if parse_shared_name(name) is None
            for key in self.keys.parts(agent_id, name, nbytes, summary.part_bytes)
        ]
        shared = [
            BlockRef(name, "", 0, nbytes, parsed[1])
            for name, nbytes in summary.blocks
            if (parsed := parse_shared_name(name)) is not None
        ]
        return own, shared, summary.part_bytes

    def _blocks_exist(self, tx: Any, agent_id: str, refs: Sequence[BlockRef]) -> bool:
        """WATCH every value of these blocks, then check they all exist: from then on none can go
        before the EXEC without aborting it (another agent's commit may collect a shared block
        without touching our manifest)."""
        keys = self.keys.of_refs(agent_id, refs, self.part_bytes)
        if not keys:
            return True
        tx.watch(*keys)
        return bool(tx.exists(*keys) == len(keys))

    def _value(self, parts: Sequence[bytes | memoryview]) -> Any:
        """What redis-py is handed as a value (a ScatterValue only reaches our own packer)."""
        return ScatterValue(parts) if self._scatter else b"".join(parts)

    def _write_blocks(self, agent_id: str, plan: WritePlan) -> builtins.list[NewBlock]:
        """SET the new blocks on their provisional expiry; returns the shared ones already stored.

        Shared blocks some agent already stored are not sent at all (one pipelined EXISTS finds
        them); the rest are SET only where absent (NX): a stored version of the same bytes is never
        overwritten or given an expiry again. On failure the policy discards what was written, best
        effort: the provisional expiry covers the rest.
        """
        linked = self._stored_shared(agent_id, plan.new_blocks)
        to_send = [block for block in plan.new_blocks if not any(block is stored for stored in linked)]
        replies = self._set_pending(
            [(agent_id, block.name, block.encoded, block.share is not None) for block in to_send]
        )
        # A shared block all of whose values were there already (NX set none) was stored meanwhile.
        raced = {id(b) for b, sets in zip(to_send, replies, strict=True) if b.share and not any(sets)}
        return linked + [b for b in plan.new_blocks if id(b) in raced]

    def _set_pending(
        self, blocks: Sequence[tuple[str, str, EncodedBlock, bool]]
    ) -> builtins.list[builtins.list[Any]]:
        """SET each (agent, name, block, only_if_absent)'s values on the provisional expiry, pipelined
        (sent every ~64 MB); the SETs' replies of each block (NX: falsy where a value was there)."""
        pipe = self._client.pipeline(transaction=False)
        counts: builtins.list[int] = []
        replies: builtins.list[Any] = []
        queued = 0
        for agent_id, name, block, nx in blocks:
            keys = self.keys.parts(agent_id, name, block.nbytes, self.part_bytes)
            for key, value in zip(keys, split_parts(block.parts(), self.part_bytes), strict=True):
                pipe.set(key, self._value(value), px=PENDING_TTL_MS, nx=nx)
            counts.append(len(keys))
            queued += block.nbytes
            if queued >= _PIPELINE_BYTES:
                replies += pipe.execute()
                queued = 0
        replies += pipe.execute()
        ends = itertools.accumulate(counts)
        return [replies[end - count : end] for count, end in zip(counts, ends, strict=True)]

    def _stored_shared(self, agent_id: str, blocks: Sequence[NewBlock]) -> builtins.list[NewBlock]:
        """The shared blocks among `blocks` whose values are all stored already."""
        shared = [block for block in blocks if block.share is not None]
        if not shared:
            return []
        pipe = self._client.pipeline(transaction=False)
        for block in shared:
            pipe.exists(*self.keys.parts(agent_id, block.name, block.encoded.nbytes, self.part_bytes))
        counts = pipe.execute()
        return [
            block
            for block, count in zip(shared, counts, strict=True)
            if count == len(self.keys.parts(agent_id, block.name, block.encoded.nbytes, self.part_bytes))
        ]

    def _swap_manifest(
        self,
        tx: Any,
        agent_id: str,
        plan: WritePlan,
        manifest: Manifest,
        manifest_blob: bytes,
        current: Blob | None,
    ) -> builtins.list[tuple[BlockRef, int]] | None:
        """One MULTI/EXEC: swap the manifest, settle block expiries, take references on its shared
        blocks and drop those of the replaced manifest, delete the agent's replaced blocks, index; then,
        with a TTL and pinned agents, lift the expiry the EXEC gave the keys pinned agents need.
        Returns the shared blocks it stopped using that are still to collect (none where Redis runs
        scripts: they are released inside the transaction)."""
        old_own, old_shared, old_part_bytes = self._stored_blocks(agent_id, current)
        own = [ref for ref in manifest.blocks if parse_shared_name(ref.name) is None]
        shared = [ref for ref in manifest.blocks if parse_shared_name(ref.name) is not None]
        own_bytes, links = split_shared((ref.name, ref.nbytes) for ref in manifest.blocks)
        own_keys = self.keys.of_refs(agent_id, own, manifest.part_bytes)
        written = set(
            self.keys.of_refs(agent_id, [block.ref() for block in plan.new_blocks], self.part_bytes)
        )
        keeps = set(own_keys)
        stale = [key for key in old_own if key not in keeps]
        names = {ref.name for ref in shared}
        released = [(ref, old_part_bytes) for ref in old_shared if ref.name not in names]
        scripted = self.shared_blocks.supports_scripts()
        tx.multi()
        tx.set(self.keys.manifest(agent_id), manifest_blob, ex=self.ttl_s)
        for key in own_keys:
            self.shared_blocks.queue_expiry(tx, key, persist=key in written)
        for ref in shared:
            self.shared_blocks.queue_link(tx, agent_id, ref, manifest.part_bytes)
        if stale:
            tx.unlink(*stale)
        self._queue_usage(tx, agent_id, own_bytes + len(manifest_blob), links)
        self.shared_blocks.queue_release(tx, agent_id, released, scripted)
        try:
            results = tx.execute()  # the EXEC
        except WatchError:
            return None  # another writer swapped the manifest meanwhile
        self.pins.hold_if_pinned(agent_id)  # the commit gave every key ttl_s: spare what pins need
        return self.shared_blocks.left_to_collect(released, results, scripted)

    def _queue_usage(self, tx: Any, agent_id: str, own_bytes: int, links: Sequence[tuple[str, int]]) -> None:
        """Index, sizes (the agent's own bytes) and links (the shared blocks it uses): its `Usage`."""
        tx.zadd(self.keys.index, {agent_id: time.time()})
        tx.hset(self.keys.sizes, agent_id, own_bytes)
        if links:
            tx.hset(self.keys.links, agent_id, links_value(links))
        else:
            tx.hdel(self.keys.links, agent_id)

    def _collect_shared(self, released: Sequence[tuple[BlockRef, int]]) -> None:
        """Delete the shared blocks no agent references any more (store/redis_shared.py)."""
        self.shared_blocks.collect(released)

    def collect_shared_garbage(self) -> int:
        return self.shared_blocks.collect_garbage()

    def _discard(self, agent_id: str, blocks: Sequence[NewBlock]) -> None:
        """UNLINK the values of the agent's own blocks of a plan that will not be committed."""
        keys = [
            key
            for block in blocks
            for key in self.keys.parts(agent_id, block.name, block.encoded.nbytes, self.part_bytes)
        ]
        if keys:
            self._client.unlink(*keys)

    # --- shared blocks of other agents ---------------------------------------------------------
    def _find_versions(self, shares: Sequence[str]) -> builtins.list[tuple[str, int, int] | None]:
        """One pipelined GET of the share keys' pointers."""
        pipe = self._client.pipeline(transaction=False)
        for share in shares:
            pipe.get(self.keys.pointer(share))
        return [parse_pointer(share, value) for share, value in zip(shares, pipe.execute(), strict=True)]

    # --- anonymous prefixes --------------------------------------------------------------------
    def _hold_blocks(self, hold: PrefixHold) -> HoldAttempt:
        """SET the blocks to send (NX, on the provisional expiry), then one MULTI/EXEC, guarded by WATCH
        on every block's values, adds PREFIX_HOLDER to each block's reference set, adopts the values
        this put wrote and records the block in `prefixes`. A block collected before the EXEC is
        reported missing; a WATCH that fired, a lost race."""
        blocks, send = hold.blocks, sorted(hold.send)
        self._set_pending([("", blocks[i][0], hold.new[i], True) for i in send])
        keys = [self.keys.parts("", name, nbytes, self.part_bytes) for name, nbytes, _crc in blocks]
        with self._client.pipeline(transaction=True) as tx:
            tx.watch(*(key for block_keys in keys for key in block_keys))
            missing = self._missing(keys)
            if missing:
                return HoldAttempt(missing=missing, written=send)
            tx.multi()
            for index, (name, nbytes, crc) in enumerate(blocks):
                self.shared_blocks.queue_prefix_hold(tx, name, nbytes, crc, keys[index], index in hold.new)
                tx.zadd(self.keys.prefixes, {name: hold.when[index]})
                tx.hset(self.keys.prefix_sizes, name, f"{nbytes}:{self.part_bytes}")
            try:
                tx.execute()
            except WatchError:
                return HoldAttempt(written=send, lost_race=True)
        self.pins.hold_shared([(name, nbytes) for name, nbytes, _ in blocks], self.part_bytes)
        return HoldAttempt(written=send)

    def _missing(self, keys: Sequence[Sequence[str]]) -> builtins.list[int]:
        """The indexes of the blocks (each given by its value keys) with a value missing."""
        pipe = self._client.pipeline(transaction=False)
        for block_keys in keys:
            pipe.exists(*block_keys)
        counts = pipe.execute()
        return [i for i, (block_keys, n) in enumerate(zip(keys, counts, strict=True)) if n != len(block_keys)]

    def _touch_prefix(self, blocks: Sequence[tuple[str, int]], when: Sequence[float]) -> None:
        pipe = self._client.pipeline(transaction=False)
        pipe.zadd(
            self.keys.prefixes, {name: used for (name, _), used in zip(blocks, when, strict=True)}, xx=True
        )
        if self.ttl_s is not None:  # like an agent's: the prefix lives ttl_s past its last use
            for name, nbytes in blocks:
                for key in self.keys.parts("", name, nbytes, self.part_bytes):
                    pipe.expire(key, self.ttl_s)
                pipe.expire(self.keys.refs(name), self.ttl_s)
                pipe.expire(self.keys.pointer(share_of(name)), self.ttl_s)
        pipe.execute()
        self.pins.hold_shared(blocks, self.part_bytes)

    def _prefix_entries(self) -> builtins.list[PrefixEntry]:
        members: Any = self._client.zrange(self.keys.prefixes, 0, -1, withscores=True)
        if not members:
            return []
        names = [as_text(member) for member, _ in members]
        sizes: Any = self._client.hmget(self.keys.prefix_sizes, names)
        users = self.shared_blocks.agent_users(names)
        entries = []
        for name, (_member, score), size, agents in zip(names, members, sizes, users, strict=True):
            nbytes, _, part_bytes = as_text(size or b"0:0").partition(":")
            entries.append(PrefixEntry(name, int(nbytes), float(score), agents, int(part_bytes or 0)))
        return entries

    def _shared_users(self, name: str) -> int:
        return self.shared_blocks.agent_users([name])[0]

    def _drop_hold(self, entry: PrefixEntry) -> bool:
        """Drop the hold and collect the block by the release every agent's commit uses (atomic: the
        block goes only if its reference set is then empty)."""
        pipe = self._client.pipeline(transaction=False)
        pipe.zrem(self.keys.prefixes, entry.name)
        pipe.hdel(self.keys.prefix_sizes, entry.name)
        pipe.execute()
        return self.shared_blocks.release_hold(entry.name, entry.nbytes, entry.part_bytes)

    # --- delete, list, info, budgets -----------------------------------------------------------
    def _delete_manifest(
        self, tx: Any, handle: str, blob: Blob | None
    ) -> builtins.list[tuple[BlockRef, int]] | None:
        """One MULTI/EXEC under the guard's WATCH: the manifest and the agent's own values, its index,
        sizes, links and pin, and its references on shared blocks (released by the script where Redis
        runs one). A damaged manifest names no blocks: its committed ones are then swept by pattern."""
        keys, shared, part_bytes = self._stored_blocks(handle, blob)
        scripted = self.shared_blocks.supports_scripts()
        tx.multi()
        tx.unlink(self.keys.manifest(handle), *keys)
        tx.zrem(self.keys.index, handle)
        tx.hdel(self.keys.sizes, handle)
        tx.hdel(self.keys.links, handle)
        tx.srem(self.keys.pinned, handle)
        released = [(ref, part_bytes) for ref in shared]
        self.shared_blocks.queue_release(tx, handle, released, scripted)
        try:
            results = tx.execute()  # the EXEC
        except WatchError:
            return None
        if blob is not None and not keys and not shared:
            self._sweep(handle)  # damaged manifest: find the agent's permanent blocks by pattern
        return self.shared_blocks.left_to_collect(released, results, scripted)

    def _sweep(self, agent_id: str) -> None:
        """Delete an agent's committed blocks (no pending expiry) when no manifest can list them."""
        pattern = f"{self.prefix}{agent_key(agent_id)}:b:*"
        for key in self._client.scan_iter(match=pattern, count=1000):
            if self._client.pttl(key) == -1:
                self._client.unlink(key)

    def _info_record(self, agent_id: str) -> tuple[Blob, float, bool] | None:
        pipe = self._client.pipeline(transaction=False)
        pipe.get(self.keys.manifest(agent_id))
        pipe.zscore(self.keys.index, agent_id)
        pipe.sismember(self.keys.pinned, agent_id)
        value, score, pinned = pipe.execute()
        blob = as_blob(value)
        if blob is None:
            return None
        return blob, float(score) if score is not None else 0.0, bool(pinned)

    def _usage(self) -> builtins.list[Usage]:
        """Indexed agents whose manifest still exists; entries of expired ones are dropped here."""
        members: Any = self._client.zrange(self.keys.index, 0, -1, withscores=True)
        if not members:
            return []
        ids = [member.decode() if isinstance(member, bytes) else str(member) for member, _ in members]
        pipe = self._client.pipeline(transaction=False)
        for agent_id in ids:
            pipe.exists(self.keys.manifest(agent_id))
        pipe.hmget(self.keys.sizes, ids)
        pipe.hmget(self.keys.links, ids)
        pipe.smembers(self.keys.pinned)
        *exists, sizes, links, pinned_ids = pipe.execute()
        pinned = {as_text(member) for member in pinned_ids}
        usage, gone = [], []
        for agent_id, (_member, score), present, size, linked in zip(
            ids, members, exists, sizes, links, strict=True
        ):
            if present:
                shared = parse_links(linked)
                usage.append(
                    Usage(agent_id, agent_id, int(size or 0), float(score), shared, agent_id in pinned)
                )
            else:
                gone.append(agent_id)
        if gone:
            pipe = self._client.pipeline(transaction=False)
            pipe.zrem(self.keys.index, *gone)
            pipe.hdel(self.keys.sizes, *gone)
            pipe.hdel(self.keys.links, *gone)
            pipe.srem(self.keys.pinned, *gone)
            pipe.execute()
        return usage

    def close(self) -> None:
        if self._owns_client:
            self._client.close()
