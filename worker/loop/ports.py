"""What the worker loop needs from the engine and the store (docs/interfaces.md), as Protocols.

The loop is written against these, so unit tests can drive it with a small fake engine.
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from engine.batch.speculation import SpeculationStats
    from engine.core.admission import Admission
    from engine.core.blocks import AgentCache, BlockPool
    from engine.core.params import SamplingParams
    from engine.core.results import Completion, StepOutput
    from engine.core.spec import ModelCacheSpec
    from store.base import CacheInfo


class Engine(Protocol):
    pool: BlockPool
    spec: ModelCacheSpec
    tokenizer: Any
    vocab_size: int  # 0 when unknown
    max_context: int  # tokens of prompt and answer together

    def admission(self, n_prompt_tokens: int, max_tokens: int) -> Admission: ...

    def check(self, params: SamplingParams) -> None:
        """InvalidRequestError for params this model can never honour (vocabulary, grammar)."""
        ...

    def free_slots(self) -> int: ...

    def reserve(self, n_prompt_tokens: int, max_tokens: int) -> bool:
        """Start making a sequence's KV buffers off the step thread (an optimisation only)."""
        ...

    def keep_ready(self, n_tokens: Sequence[int]) -> int:
        """Make idle KV buffers for sequences of these lengths now (a fresh worker's warm-up)."""
        ...

    def submit(
        self,
        agent_id: str | None,
        prompt_tokens: Sequence[int],
        params: SamplingParams,
        *,
        cache: AgentCache | None = None,
        keep_cache: bool = True,
    ) -> int: ...

    def step(self) -> StepOutput: ...

    def cancel(self, uid: int) -> Completion | None: ...

    def finish(self, uid: int) -> Completion | None:
        """End the sequence as stopped, its KV kept; its completion now or from a later step."""
        ...

    def has_work(self) -> bool: ...

    def memory(self) -> dict[str, int]:
        """Bytes held by kind (BlockPoolBatchEngine.memory), for the worker hash."""
        ...

    def speculation_stats(self) -> SpeculationStats | None:
        """Drafted steps, draft tokens verified and accepted so far; None with speculation off."""
        ...

    def close(self) -> None: ...


class Store(Protocol):
    """`namespace` everywhere: the tenant whose shared blocks a call may reuse and feed (None: the
    store's own); the worker narrows it per job, never widens it."""

    def prefetch(
        self,
        agent_id: str,
        *,
        prompt_tokens: Sequence[int] | None,
        fence: int | None = None,
        namespace: str | None = None,
    ) -> Future[AgentCache | None]:
        """The agent's cache (prefix shared with the prompt; all of it without one), read and decoded
        off the caller's thread; with `fence` (the caller's turn), never older than the previous turn's."""
        ...

    def put(
        self, agent_id: str, cache: AgentCache, *, fence: int | None = None, namespace: str | None = None
    ) -> Future[bool]:
        """Returns at once; the future is True once every worker's get sees the cache (False: stale)."""
        ...

    def prefetch_prefix(
        self, prompt_tokens: Sequence[int], *, namespace: str | None = None
    ) -> Future[AgentCache | None]:
        """The longest run of full blocks of the prompt any job of the namespace stored (no agent needed)."""
        ...

    def put_prefix(self, cache: AgentCache, *, namespace: str | None = None) -> Future[bool]:
        """Keep the cache's full blocks for later jobs without an agent (best effort, written behind)."""
        ...

    def stats(self) -> dict[str, int]:
        """Counters and gauges (hot_hits, hot_misses, hits, hot_entries, ...), for status and metrics."""
        ...

    def list(self) -> builtins.list[str]:
        """The agents it holds a cache for."""
        ...

    def info(self, agent_id: str) -> CacheInfo | None:
        """One agent's cache: length, size, last use (None: none held)."""
        ...

    def close(self) -> None: ...
