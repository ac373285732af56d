"""Refcounted shared blocks in Redis: the references agents and prefix holds take, and their collector.

A shared block's reference set names every agent whose manifest uses it (and PREFIX_HOLDER while
the prefix budget holds it). References are taken and dropped inside the MULTI that swaps an
agent's manifest; a block is deleted when its set empties, atomically (the Lua release; WATCH/MULTI
where the server runs no scripts), so a writer adopting it at that moment either commits first (the
block stays) or finds it gone under its own WATCH and writes it again.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import redis
from redis.exceptions import RedisError, ResponseError, WatchError

from store.base import Stats, log
from store.manifest import BlockRef, parse_shared_name
from store.redis_keys import RedisKeys, pointer_value, share_of

# Drops an agent's reference to a shared block and deletes the block if no agent references it, atomically.
# KEYS: its reference set, its share key's pointer, its values. ARGV: the pointer value naming this
# version, the agent id ('' to only collect). Runs inside the MULTI that swaps the agent's manifest, so a
# crash cannot come between the two; also works when Redis is out of memory, where MULTI refuses deletes.
RELEASE_SHARED = """
if ARGV[2] ~= '' then redis.call('SREM', KEYS[1], ARGV[2]) end
if redis.call('SCARD', KEYS[1]) > 0 then return 0 end
for i = 3, #KEYS do redis.call('UNLINK', KEYS[i]) end
if redis.call('GET', KEYS[2]) == ARGV[1] then redis.call('DEL', KEYS[2]) end
return 1
"""
# The prefix hold: a member of a shared block's reference set that no agent id can be ('*' is outside
# the id rule), so the refcounting that keeps a block while an agent uses it keeps it for prefixes too.
PREFIX_HOLDER = "*prefix"


class SharedBlocks:
    """The reference sets and pointers of one store's shared blocks, and their collection."""

    def __init__(self, client: redis.Redis, keys: RedisKeys, stats: Stats, ttl_s: int | None) -> None:
        self._client = client
        self.keys = keys
        self._stats = stats
        self.ttl_s = ttl_s
        self.scripting: bool | None = None  # whether the server runs Lua (fakeredis without lupa does not)

    def supports_scripts(self) -> bool:
        if self.scripting is None:
            try:
                self._client.eval("return 1", 0)
                self.scripting = True
            except ResponseError as exc:
                if "unknown command" not in str(exc).lower():
                    raise
                self.scripting = False
        return self.scripting

    def agent_users(self, names: Sequence[str]) -> list[int]:
        """The reference count of each shared block: the agents in its reference set (the prefix hold
        is not one), read in one pipeline."""
        pipe = self._client.pipeline(transaction=False)
        for name in names:
            pipe.scard(self.keys.refs(name))
            pipe.sismember(self.keys.refs(name), PREFIX_HOLDER)
        replies = pipe.execute()
        return [int(members) - int(held) for members, held in zip(replies[::2], replies[1::2], strict=True)]

    # --- inside a MULTI ------------------------------------------------------------------------
    def queue_expiry(self, tx: Any, key: str, *, persist: bool) -> None:
        """A committed value's expiry: the agent TTL when there is one; otherwise none, where `persist`
        says the value may still carry a provisional expiry (PERSIST drops it)."""
        if self.ttl_s is not None:
            tx.expire(key, self.ttl_s)
        elif persist:
            tx.persist(key)

    def queue_link(self, tx: Any, agent_id: str, ref: BlockRef, part_bytes: int) -> None:
        """Take the agent's reference on a shared block: its values adopted (ours or another writer's
        provisional ones), the agent added to its reference set, its pointer set unless one exists."""
        for key in self.keys.parts(agent_id, ref.name, ref.nbytes, part_bytes):
            self.queue_expiry(tx, key, persist=True)
        tx.sadd(self.keys.refs(ref.name), agent_id)
        tx.set(
            self.keys.pointer(share_of(ref.name)),
            pointer_value(ref.crc32, ref.nbytes),
            nx=True,
            ex=self.ttl_s,
        )
        self.queue_expiry(tx, self.keys.refs(ref.name), persist=False)

    def queue_prefix_hold(
        self, tx: Any, name: str, nbytes: int, crc: int, keys: Sequence[str], wrote: bool
    ) -> None:
        """The prefix's reference on a shared block, its values adopted, its pointer set (replacing a
        stale one when this put wrote the block, else only where there is none)."""
        for key in keys:
            self.queue_expiry(tx, key, persist=True)
        tx.sadd(self.keys.refs(name), PREFIX_HOLDER)
        self.queue_expiry(tx, self.keys.refs(name), persist=False)
        tx.set(self.keys.pointer(share_of(name)), pointer_value(crc, nbytes), nx=not wrote, ex=self.ttl_s)

    def queue_release(
        self, tx: Any, holder: str, released: Sequence[tuple[BlockRef, int]], scripted: bool
    ) -> None:
        """Queue, last in the MULTI, dropping `holder`'s references to `released`; with scripting a
        block left unused is deleted in the same transaction."""
        for ref, part_bytes in released:
            if scripted:
                keys, pointer = self.keys.release(ref, part_bytes)
                tx.eval(RELEASE_SHARED, len(keys), *keys, pointer, holder)
            else:
                tx.srem(self.keys.refs(ref.name), holder)

    def left_to_collect(
        self, released: Sequence[tuple[BlockRef, int]], results: list[Any], scripted: bool
    ) -> list[tuple[BlockRef, int]]:
        """After the EXEC: the released blocks `collect` must still check and delete (all of them
        without scripting; none with it, where the scripts' own collections are counted here)."""
        if not scripted:
            return list(released)
        if released:
            self._stats.add("shared_collected", sum(int(r) for r in results[-len(released) :]))
        return []

    # --- collection ----------------------------------------------------------------------------
    def collect(self, released: Sequence[tuple[BlockRef, int]]) -> None:
        """Delete the shared blocks no agent references any more (and their pointer if it names them),
        each check-and-delete atomic."""
        for ref, part_bytes in released:
            if parse_shared_name(ref.name) is None:
                continue
            keys, pointer = self.keys.release(ref, part_bytes)
            try:
                collected = self.collect_one(keys, pointer)
            except RedisError as exc:
                log.warning("redis: could not collect shared block %s: %r", ref.name, exc)
                continue
            if collected:
                self._stats.add("shared_collected")

    def collect_one(self, keys: list[str], pointer: str) -> bool:
        if self.supports_scripts():
            return bool(self._client.eval(RELEASE_SHARED, len(keys), *keys, pointer, ""))
        refs_key, pointer_key, *values = keys
        try:
            with self._client.pipeline(transaction=True) as tx:
                tx.watch(*keys)
                if tx.scard(refs_key):
                    return False
                names_it = tx.get(pointer_key) == pointer.encode()
                tx.multi()
                tx.unlink(*values)
                if names_it:
                    tx.delete(pointer_key)
                tx.execute()
        except WatchError:
            return False  # someone touched it meanwhile: it is in use again
        return True

    def release_hold(self, name: str, nbytes: int, part_bytes: int) -> bool:
        """Drop the prefix hold on a block and collect it if no agent references it (atomic: the
        block goes only if its reference set is then empty)."""
        parsed = parse_shared_name(name)
        if parsed is None:
            return False
        keys, pointer = self.keys.release(BlockRef(name, "", 0, nbytes, parsed[1]), part_bytes)
        if self.supports_scripts():
            return bool(self._client.eval(RELEASE_SHARED, len(keys), *keys, pointer, PREFIX_HOLDER))
        self._client.srem(self.keys.refs(name), PREFIX_HOLDER)
        return self.collect_one(keys, pointer)

    def collect_garbage(self) -> int:
        """Collect every committed shared block no agent references (left by a damaged manifest, or a
        writer killed between its EXEC and a collection on a server without scripting). Returns how
        many were removed. Scans the keyspace: for maintenance, not for every put."""
        prefix = self.keys.prefix
        shape = re.compile(re.escape(prefix) + r"s:([0-9a-f]{32}\.[0-9a-f]{8})(?::(\d+))?")
        parts: dict[str, list[str]] = {}
        for raw in self._client.scan_iter(match=f"{prefix}s:*", count=1000):
            key = raw.decode() if isinstance(raw, bytes) else str(raw)
            match = shape.fullmatch(key)
            if match is not None:
                parts.setdefault(match.group(1), []).append(key)
        before = self._stats.snapshot().get("shared_collected", 0)
        for name, keys in parts.items():
            base = f"{prefix}s:{name}"
            if base not in keys or self._client.pttl(base) != -1 or self._client.exists(self.keys.refs(name)):
                continue  # provisional (a put in flight), or in use
            nbytes = sum(int(self._client.strlen(key)) for key in keys)
            crc = int(name.partition(".")[2], 16)
            refs_key, pointer_key = self.keys.refs(name), self.keys.pointer(share_of(name))
            try:
                if self.collect_one([refs_key, pointer_key, *sorted(keys)], pointer_value(crc, nbytes)):
                    self._stats.add("shared_collected")
            except RedisError as exc:
                log.warning("redis: could not collect shared block %s: %r", name, exc)
        return self._stats.snapshot().get("shared_collected", 0) - before
