"""What the worker loop needs from the engine and the store (docs/interfaces.md), as Protocols.

The loop is written against these, so unit tests can drive it with a small fake engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from engine.blocks import AgentCache, BlockPool
    from engine.results import Completion, StepOutput
    from engine.spec import ModelCacheSpec


class Engine(Protocol):
    spec: ModelCacheSpec
    pool: BlockPool
    tokenizer: Any

    def submit(
        self,
        agent_id: str | None,
        prompt_tokens: Sequence[int],
        *,
        cache: AgentCache | None = None,
        max_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        stop_tokens: Sequence[int] = (),
        keep_cache: bool = True,
    ) -> int: ...

    def step(self) -> StepOutput: ...

    def cancel(self, uid: int) -> Completion | None: ...

    def has_work(self) -> bool: ...

    def active(self) -> int: ...

    def can_admit(self, n_prompt_tokens: int, max_tokens: int) -> bool: ...

    def free_slots(self) -> int: ...


class Store(Protocol):
    def get(self, agent_id: str, *, prompt_tokens: Sequence[int] | None = None) -> AgentCache | None: ...

    def put(self, agent_id: str, cache: AgentCache) -> None: ...

    def close(self) -> None: ...
