"""BlockBackend: what every backend of the hot tier offers (the CacheStore calls, budgets, prefixes), and
the checks each call makes before any I/O.

A backend that stores caches itself is a BlockStore (store/policy.py: the policy written once over the
primitives its docstring lists; store/commit.py: the put), DiskStore or RedisStore; ShardedStore routes
each call to the BlockStore that holds the agent.
"""

from __future__ import annotations

import builtins
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, TypedDict

from engine.core.blocks import AgentCache
from engine.core.spec import ModelCacheSpec
from producer.wire.ids import validate_agent_id
from store import layered_codec, quant
from store.base import BACKEND_COUNTERS, CacheInfo, Stats
from store.manifest import Manifest

if TYPE_CHECKING:
    pass  # typing's own from Python 3.11

Blob = bytes | bytearray | memoryview
DEFAULT_NAMESPACE = "default"
# Anonymous prefixes (get_prefix / put_prefix) are held under their own budget: by default a quarter of
# the store's max_bytes, or this much in a store without one; 0 turns them off.
DEFAULT_PREFIX_BYTES = 1024 * 1024 * 1024
# A put, delete or prefix hold that keeps losing its transaction to other writers retries, after a random
# pause that doubles up to RACE_PAUSE_CAP_S (full jitter: tight-looping writers fall out of step),
# until RACE_BUDGET_S is spent and at least RACE_MIN_ATTEMPTS were made; then it raises StoreError.
RACE_BUDGET_S = 10.0
RACE_MIN_ATTEMPTS = 8
RACE_PAUSE_CAP_S = 0.05


class BackendOptions(TypedDict, total=False):
    """The options every backend that stores caches takes, as BlockBackend documents them."""

    quantization: str
    group_size: int
    max_bytes: int | None
    namespace: str
    prefix_max_bytes: int | None


def check_namespace(namespace: object) -> str:
    """Return `namespace` if it is a valid tenant name (1 to 200 characters), else raise ValueError."""
    if not isinstance(namespace, str) or not 0 < len(namespace) <= 200:
        raise ValueError(f"namespace must be a string of 1 to 200 characters, got {namespace!r}")
    return namespace


def check_fence(fence: object) -> None:
    """Raise unless `fence` is None or a non-negative int (a caller's bug, caught before any I/O)."""
    if fence is None:
        return
    if not isinstance(fence, int) or isinstance(fence, bool):
        raise TypeError(f"fence must be an int or None, not {type(fence).__name__}")
    if fence < 0:
        raise ValueError(f"fence must be >= 0, got {fence}")


class BlockBackend(ABC):
    """Base of the block-structured backends (one manifest + one blob per block per agent)."""

    kind = "backend"
    part_bytes = 0  # blocks are stored as values of at most this many bytes (0: one value per block)

    def __init__(
        self,
        spec: ModelCacheSpec,
        *,
        quantization: str = "none",
        group_size: int = 64,
        max_bytes: int | None = None,
        namespace: str = DEFAULT_NAMESPACE,
        prefix_max_bytes: int | None = None,
        ttl_s: float | None = None,
    ) -> None:
        check_namespace(namespace)
        quant.check_quantization(quantization, group_size, layered_codec.head_dims(spec))
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        if prefix_max_bytes is None:
            prefix_max_bytes = DEFAULT_PREFIX_BYTES if max_bytes is None else max_bytes // 4
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.ttl_s = ttl_s  # an agent unused this long expires, unless pinned (None: never)
        if prefix_max_bytes < 0:
            raise ValueError(
                f"prefix_max_bytes must be >= 0 (0: no anonymous prefixes), got {prefix_max_bytes}"
            )
        self.prefix_max_bytes = prefix_max_bytes
        self.spec = spec
        self.namespace = namespace
        self.quantization = quantization
        self.group_size = group_size if quantization != "none" else 0
        self.max_bytes = max_bytes
        self._stats = Stats(BACKEND_COUNTERS)

    def put(
        self, agent_id: str, cache: AgentCache, *, fence: int | None = None, namespace: str | None = None
    ) -> bool:
        """Store the cache, its full blocks in `namespace`'s shared area (None: the store's); False
        (nothing written) if `fence` is lower than the stored one."""
        validate_agent_id(agent_id)
        check_fence(fence)
        namespace = self.effective_namespace(namespace)
        cache.validate(self.spec)  # before any I/O: a foreign cache leaves no trace
        return self._write(agent_id, cache, fence, namespace)

    @abstractmethod
    def _write(self, agent_id: str, cache: AgentCache, fence: int | None, namespace: str) -> bool:
        """`put` once its arguments are checked: the guarded compare-and-swap of a backend that stores
        blocks itself (store/commit.py), or a call to the store that holds the agent (sharded)."""

    @abstractmethod
    def get(
        self, agent_id: str, *, prompt_tokens: Sequence[int] | None = None, namespace: str | None = None
    ) -> AgentCache | None:
        """The agent's cache (cut to what the prompt shares with it), or a warm start from another
        agent's blocks of the namespace; None (a counted miss) otherwise."""

    @abstractmethod
    def read_manifest(self, agent_id: str) -> Manifest | None:
        """The agent's manifest if it is present and intact (no block is read)."""

    @abstractmethod
    def delete(self, agent_id: str) -> bool:
        """Delete the agent's cache; False if there was none."""

    @abstractmethod
    def pin(self, agent_id: str) -> bool:
        """Keep the agent's cache past the store's budget and TTL; False if there is none to pin."""

    @abstractmethod
    def unpin(self, agent_id: str) -> bool:
        """Let budget and TTL apply to the agent again; False if it was not pinned."""

    @abstractmethod
    def info(self, agent_id: str) -> CacheInfo | None:
        """What the agent's manifest says (no block is read, no model needed); None if there is no
        intact manifest of this agent."""

    @abstractmethod
    def list(self) -> builtins.list[str]:
        """Every agent the store holds and has not expired."""

    @abstractmethod
    def record_miss(self, agent_id: str, reason: str, detail: str) -> None:
        """Count and log a miss found by a layer in front of this backend (the hot tier)."""

    @abstractmethod
    def get_prefix(self, prompt_tokens: Sequence[int], *, namespace: str | None = None) -> AgentCache | None:
        """The longest run of full blocks of the prompt that any job of the namespace stored, or None."""

    @abstractmethod
    def put_prefix(self, cache: AgentCache, *, namespace: str | None = None) -> bool:
        """Hold the cache's full blocks for later jobs of the namespace, without an agent."""

    @abstractmethod
    def enforce_budget(self, keep: str | None = None) -> int:
        """Evict least-recently-used agents until the store fits max_bytes; how many were evicted."""

    @abstractmethod
    def enforce_prefix_budget(self) -> int:
        """Evict held prefix blocks no agent links until they fit prefix_max_bytes; how many."""

    def effective_namespace(self, namespace: str | None) -> str:
        """The namespace a call works in: its own, or the store's."""
        return self.namespace if namespace is None else check_namespace(namespace)

    def _backend_errors(self) -> tuple[type[Exception], ...]:
        """The client library's error types (Redis's), besides OSError."""
        return ()

    def _io_errors(self) -> tuple[type[Exception], ...]:
        return (OSError, *self._backend_errors())

    def stats(self) -> dict[str, int]:
        return self._stats.snapshot()

    def close(self) -> None:
        """Release the backend's connections (nothing to release where every put is durable on return)."""
        return None


def race_attempts(budget_s: float | None = None) -> Iterator[int]:
    """Numbers 1, 2, ... for the attempts of an optimistic transaction (a WATCH in Redis; on disk, a
    prefix hold on a block collected meanwhile), pausing before each retry; ends once the budget is
    spent and RACE_MIN_ATTEMPTS were made. A budget in time, not in attempts, because how often a
    writer loses depends on how busy the machine is, not on the writer."""
    deadline = time.monotonic() + (RACE_BUDGET_S if budget_s is None else budget_s)
    attempt = 1
    while True:
        yield attempt
        if attempt >= RACE_MIN_ATTEMPTS and time.monotonic() >= deadline:
            return
        time.sleep(random.uniform(0, min(RACE_PAUSE_CAP_S, 0.001 * 2**attempt)))
        attempt += 1
