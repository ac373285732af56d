"""Pins and TTLs in Redis: the sliding expiry of an agent's keys, and the pins that lift it.

With `ttl_s` every key of an agent lives ttl_s past its last use, and a shared block ttl_s past its
last use by any agent. A pinned agent (`kvrq cache pin`) is in the `pinned` set: budgets skip it
(BlockStore's policy), and here its keys and those of the shared blocks it uses, whoever touches
them, lose their expiry.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import redis

from producer.wire.text import as_text
from store.errors import BadCacheError
from store.manifest import Manifest, parse_shared_name, summarize_manifest
from store.redis_keys import RedisKeys, as_blob, share_of


class PinnedKeys:
    """The expiries of one store's keys (`ttl_s`; None: keys never expire) and its pinned agents."""

    def __init__(self, client: redis.Redis, keys: RedisKeys, ttl_s: int | None) -> None:
        self._client = client
        self.keys = keys
        self.ttl_s = ttl_s

    def _any_pinned(self) -> bool:
        """Whether expiries must spare some keys (a TTL, and at least one pinned agent)."""
        return self.ttl_s is not None and bool(self._client.scard(self.keys.pinned))

    def touch(self, agent_id: str, manifest: Manifest) -> None:
        """Record the agent's use (the index) and slide its keys' expiry."""
        if self._any_pinned():
            self._client.zadd(self.keys.index, {agent_id: time.time()}, xx=True)
            blocks = [(ref.name, ref.nbytes) for ref in manifest.blocks]
            self.hold(agent_id, blocks, manifest.part_bytes, slide=True)
            return
        pipe = self._client.pipeline(transaction=False)
        pipe.zadd(self.keys.index, {agent_id: time.time()}, xx=True)
        if self.ttl_s is not None:  # sliding expiry: the whole cache lives ttl_s past its last use
            pipe.expire(self.keys.manifest(agent_id), self.ttl_s)
            for key in self.keys.of_refs(agent_id, manifest.blocks, manifest.part_bytes):
                pipe.expire(key, self.ttl_s)
            for ref in manifest.blocks:  # a shared block lives ttl_s past its last use by any agent
                parsed = parse_shared_name(ref.name)
                if parsed is not None:
                    pipe.expire(self.keys.refs(ref.name), self.ttl_s)
                    pipe.expire(self.keys.pointer(parsed[0]), self.ttl_s)
        pipe.execute()

    def hold(
        self, agent_id: str | None, blocks: Sequence[tuple[str, int]], part_bytes: int, *, slide: bool = False
    ) -> None:
        """With a TTL and pinned agents: the keys a pinned agent needs (its own, and the shared blocks
        it uses, whoever touches them) lose their expiry; with `slide` the others get ttl_s again.
        `agent_id` None: only shared blocks (held for anonymous prefixes)."""
        assert self.ttl_s is not None
        pinned = {as_text(member) for member in self._client.smembers(self.keys.pinned)}
        shared = [(name, nbytes) for name, nbytes in blocks if parse_shared_name(name) is not None]
        pipe = self._client.pipeline(transaction=False)
        for name, _ in shared:
            pipe.smembers(self.keys.refs(name))
        users = pipe.execute()
        held = agent_id in pinned
        groups: list[tuple[list[str], bool]] = []
        if agent_id is not None:
            own = [self.keys.manifest(agent_id)]
            for name, nbytes in blocks:
                if parse_shared_name(name) is None:
                    own += self.keys.parts(agent_id, name, nbytes, part_bytes)
            groups.append((own, held))
        for (name, nbytes), refs in zip(shared, users, strict=True):
            keys = [*self.keys.parts("", name, nbytes, part_bytes), self.keys.refs(name)]
            keys.append(self.keys.pointer(share_of(name)))
            groups.append((keys, held or bool(pinned & {as_text(user) for user in refs})))
        pipe = self._client.pipeline(transaction=False)
        for keys, keep in groups:
            for key in keys:
                if keep:
                    pipe.persist(key)
                elif slide:
                    pipe.expire(key, self.ttl_s)
        pipe.execute()

    def hold_shared(self, blocks: Sequence[tuple[str, int]], part_bytes: int) -> None:
        """After shared blocks were given ttl_s (a prefix hold or touch): spare those a pinned agent uses."""
        if self._any_pinned():
            self.hold(None, blocks, part_bytes)

    def hold_if_pinned(self, agent_id: str) -> None:
        """After a commit gave every key of the agent ttl_s: spare those pinned agents need."""
        if self._any_pinned():
            stored = self._stored_refs(agent_id)
            if stored is not None:
                self.hold(agent_id, *stored)

    def _stored_refs(self, agent_id: str) -> tuple[list[tuple[str, int]], int] | None:
        """(block name, bytes) of the agent's stored cache and its part size; no model needed."""
        blob = as_blob(self._client.get(self.keys.manifest(agent_id)))
        if blob is None:
            return None
        try:
            summary = summarize_manifest(blob)
        except BadCacheError:
            return None
        return list(summary.blocks), summary.part_bytes

    def pin(self, agent_id: str) -> bool:
        stored = self._stored_refs(agent_id)
        if stored is None:
            return False
        self._client.sadd(self.keys.pinned, agent_id)
        if self.ttl_s is not None:
            self.hold(agent_id, *stored)
        return True

    def unpin(self, agent_id: str) -> bool:
        if not self._client.srem(self.keys.pinned, agent_id):
            return False
        stored = self._stored_refs(agent_id)
        if stored is not None and self.ttl_s is not None:
            self.hold(agent_id, *stored, slide=True)  # its keys expire ttl_s from now
        return True
