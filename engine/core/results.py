"""What step() hands back: token deltas for streaming and completions for finished sequences."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from engine.core.blocks import AgentCache

FinishReason = Literal["stop", "length", "canceled"]


@dataclass(frozen=True)
class TokenLogprobs:
    """A generated token's log probability and the most likely tokens of its step (ids, best first)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class TokenDelta:
    uid: int
    token: int
    text: str  # decoded text that became final with this token (may be "" mid-character)
    logprobs: TokenLogprobs | None = None  # when the request asked for them


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    reused_tokens: int  # prompt tokens whose KV came from the agent's saved cache
    prefilled_tokens: int  # prompt tokens run through the model for this request
    generated_tokens: int


@dataclass
class Completion:
    uid: int
    agent_id: str | None
    text: str
    token_ids: list[int]  # generated tokens only
    finish_reason: FinishReason
    usage: Usage
    cache: AgentCache | None  # prompt + generated tokens as blocks; None when canceled
    time_to_first_token_s: float | None = None
    total_time_s: float = 0.0
    logprobs: list[TokenLogprobs] | None = None  # one per generated token, when the request asked


@dataclass
class StepOutput:
    deltas: list[TokenDelta] = field(default_factory=list)
    completions: list[Completion] = field(default_factory=list)
