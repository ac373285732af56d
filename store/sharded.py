"""ShardedStore: agents' caches spread over several independent Redis primaries, routed by hash.

Why independent primaries and not Redis Cluster: every atomic step of RedisStore (the WATCH/MULTI that
swaps a manifest, the Lua release of a shared block, the pipelined reads) touches one agent's keys
together with store-wide ones (index, sizes, links, shared blocks). Routing *all* of an agent's keys,
and the store-wide keys of the agents it holds, to one primary keeps each step on one server unchanged;
on Cluster each would need one hash slot (docs/scale-out.md has the measurements).

Routing is rendezvous (highest random weight) hashing: an agent lives on the shard whose name scores
highest with its id, so adding a shard to N moves about 1/(N+1) of the agents (to the new one) and
removing one moves only its own. Agent ids are store-wide (as in one Redis: the namespace is a field
of the manifest, and delete, info and pin take no namespace), so the id alone routes. Anonymous
prefixes (get_prefix / put_prefix) route by their namespace and first full block's tokens: every
prompt that shares a first block finds it on one shard. The cost: shared blocks are stored once per
shard, not once per store, and an agent warm-starts only from agents of its own shard.

A shard that cannot be reached makes its own agents' reads counted misses (`miss_backend_error`) and
their writes fail (the hot tier counts `write_errors`); the other shards' agents never touch it.
Store-wide calls (list, budgets) name the shard that failed.
"""

from __future__ import annotations

import builtins
import hashlib
from collections.abc import Callable, Sequence
from typing import TypeVar

from engine.core.blocks import AgentCache
from producer.wire.ids import validate_agent_id
from store.backend import BlockBackend
from store.base import CacheInfo, log
from store.errors import StoreError
from store.manifest import Manifest

T = TypeVar("T")


def weight(shard: str, key: bytes) -> int:
    """The rendezvous score of `key` on the shard named `shard` (stable across processes and hosts)."""
    digest = hashlib.blake2b(shard.encode() + b"\0" + key, digest_size=8)
    return int.from_bytes(digest.digest(), "big")


def pick(names: Sequence[str], key: bytes) -> int:
    """The index of the shard that holds `key`: the highest score, ties (never seen) to the first."""
    scores = [weight(name, key) for name in names]
    return scores.index(max(scores))


def agent_route_key(agent_id: str) -> bytes:
    return b"agent\0" + agent_id.encode()


def prefix_route_key(namespace: str, first_block: Sequence[int]) -> bytes:
    """What an anonymous prefix routes by: its namespace and the tokens of its first full block
    (with the store's model and quantization, which every shard shares, that is its content key)."""
    return b"prefix\0" + namespace.encode() + b"\0" + ",".join(map(str, first_block)).encode()


class ShardedStore(BlockBackend):
    """A BlockBackend that delegates each call to the shard (a RedisStore) its key routes to."""

    kind = "sharded"

    def __init__(self, shards: Sequence[BlockBackend], names: Sequence[str]) -> None:
        if not shards or len(shards) != len(names):
            raise ValueError("a sharded store needs one name per shard, and at least one shard")
        if len(set(names)) != len(names):
            raise ValueError(f"shard names must differ: {list(names)}")
        first = shards[0]
        for shard in shards[1:]:
            same = (shard.spec, shard.quantization, shard.group_size, shard.namespace, shard.part_bytes)
            if same != (first.spec, first.quantization, first.group_size, first.namespace, first.part_bytes):
                raise ValueError("every shard must have the same model spec, quantization and namespace")
        super().__init__(
            first.spec,
            quantization=first.quantization,
            group_size=first.group_size or 64,
            max_bytes=None,  # each shard keeps its own budget (a share of the store's)
            namespace=first.namespace,
            prefix_max_bytes=sum(shard.prefix_max_bytes for shard in shards),
        )
        self.group_size = first.group_size
        self.part_bytes = first.part_bytes
        self.max_bytes = None if first.max_bytes is None else sum(s.max_bytes or 0 for s in shards)
        self.shards = list(shards)
        self.names = list(names)

    # --- routing -------------------------------------------------------------------------------
    def shard_index(self, agent_id: str) -> int:
        return pick(self.names, agent_route_key(agent_id))

    def shard_for(self, agent_id: str) -> BlockBackend:
        """The shard that holds the agent's cache."""
        return self.shards[self.shard_index(agent_id)]

    def prefix_shard(self, prompt_tokens: Sequence[int], namespace: str | None) -> BlockBackend:
        """The shard that holds the anonymous prefixes starting with this prompt's first full block."""
        first = list(prompt_tokens[: self.spec.block_tokens]) if self.spec.block_tokens else []
        key = prefix_route_key(self.effective_namespace(namespace), first)
        return self.shards[pick(self.names, key)]

    def _each(self, action: Callable[[BlockBackend], T], what: str) -> builtins.list[T]:
        """`action(shard)` on every shard, in order; a shard that fails raises StoreError naming it."""
        results = []
        for index, shard in enumerate(self.shards):
            try:
                results.append(action(shard))
            except shard._io_errors() as exc:
                raise StoreError(
                    f"{what}: shard {index + 1} of {len(self.shards)} ({self.names[index]}) failed: {exc!r}"
                ) from exc
        return results

    # --- per agent: one shard ------------------------------------------------------------------
    def get(
        self, agent_id: str, *, prompt_tokens: Sequence[int] | None = None, namespace: str | None = None
    ) -> AgentCache | None:
        validate_agent_id(agent_id)
        return self.shard_for(agent_id).get(agent_id, prompt_tokens=prompt_tokens, namespace=namespace)

    def _write(self, agent_id: str, cache: AgentCache, fence: int | None, namespace: str) -> bool:
        return self.shard_for(agent_id)._write(agent_id, cache, fence, namespace)

    def read_manifest(self, agent_id: str) -> Manifest | None:
        return self.shard_for(validate_agent_id(agent_id)).read_manifest(agent_id)

    def record_miss(self, agent_id: str, reason: str, detail: str) -> None:
        self.shard_for(agent_id).record_miss(agent_id, reason, detail)

    def info(self, agent_id: str) -> CacheInfo | None:
        return self.shard_for(validate_agent_id(agent_id)).info(agent_id)

    def pin(self, agent_id: str) -> bool:
        return self.shard_for(validate_agent_id(agent_id)).pin(agent_id)

    def unpin(self, agent_id: str) -> bool:
        return self.shard_for(validate_agent_id(agent_id)).unpin(agent_id)

    def delete(self, agent_id: str) -> bool:
        """Delete the agent on its shard, and any copy a shard held before shards were added (so a
        deleted agent cannot come back if shards are removed again). Shards that cannot be reached,
        other than its own, are skipped with a warning."""
        validate_agent_id(agent_id)
        home = self.shard_index(agent_id)
        existed = self.shards[home].delete(agent_id)
        for index, shard in enumerate(self.shards):
            if index == home:
                continue
            try:
                existed = shard.delete(agent_id) or existed
            except shard._io_errors() as exc:
                log.warning(
                    "sharded: could not check shard %s for a stray copy of %r: %r",
                    self.names[index],
                    agent_id,
                    exc,
                )
        return existed

    # --- anonymous prefixes: routed by their first block ----------------------------------------
    def get_prefix(self, prompt_tokens: Sequence[int], *, namespace: str | None = None) -> AgentCache | None:
        return self.prefix_shard(prompt_tokens, namespace).get_prefix(prompt_tokens, namespace=namespace)

    def put_prefix(self, cache: AgentCache, *, namespace: str | None = None) -> bool:
        shard = self.prefix_shard(cache.token_ids, namespace)
        return shard.put_prefix(cache, namespace=namespace)

    # --- store-wide: every shard ----------------------------------------------------------------
    def list(self) -> builtins.list[str]:
        """Every agent a get can serve: those each shard holds and routes to itself. (Copies left on a
        shard by adding shards are not listed: no get reads them, and its budget evicts them first.)"""
        found = self._each(lambda shard: shard.list(), "list")
        return sorted(a for index, ids in enumerate(found) for a in ids if self.shard_index(a) == index)

    def stats(self) -> dict[str, int]:
        """The shards' counters, summed (a shard that cannot be reached still counts: they are local)."""
        total: dict[str, int] = {}
        for shard in self.shards:
            for name, value in shard.stats().items():
                total[name] = total.get(name, 0) + value
        return total

    def enforce_budget(self, keep: str | None = None) -> int:
        """Each shard keeps its own share of the budget; returns how many agents were evicted."""
        return sum(self._each(lambda shard: shard.enforce_budget(keep=keep), "enforce_budget"))

    def enforce_prefix_budget(self) -> int:
        return sum(self._each(lambda shard: shard.enforce_prefix_budget(), "enforce_prefix_budget"))

    def close(self) -> None:
        for shard in self.shards:
            shard.close()

    def _backend_errors(self) -> tuple[type[Exception], ...]:
        return tuple({error for shard in self.shards for error in shard._backend_errors()})
