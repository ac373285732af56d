"""Pydantic models of a generation job: what a producer sends and what a worker returns.

The worker validates every payload again with the same `GenerationRequest`: a job written
by another client (plain rq, another language) is untrusted input.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from producer.protocol import agent_id_problem

QUEUE_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
MAX_PROMPT_CHARS = 1_000_000
MAX_MESSAGES = 1024
MAX_TOKENS_LIMIT = 32768
MAX_STOP_STRINGS = 16
MAX_METADATA_BYTES = 64 * 1024

#: Fields that steer rq (which queue, how long) rather than generation; not part of the job payload.
QUEUE_OPTION_FIELDS = frozenset({"queue", "at_front", "job_timeout", "result_ttl", "retries"})

FinishReason = Literal["stop", "length", "canceled"]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    role: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_-]{0,31}$")
    content: str = Field(max_length=MAX_PROMPT_CHARS)


class GenerationRequest(BaseModel):
    """One generation job. Exactly one of `prompt` (raw text) or `messages` (chat) is given."""

    model_config = ConfigDict(extra="forbid")

    agent_id: str | None = Field(
        default=None,
        description="resume from and save to this agent's KV cache; None for a one-off job "
        "(the rule: producer.protocol.agent_id_problem)",
    )
    prompt: str | None = Field(default=None, min_length=1, max_length=MAX_PROMPT_CHARS)
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int = Field(default=256, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float = Field(default=0.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    metadata: dict[str, Any] = Field(default_factory=dict, description="opaque, echoed back in the result")

    # Queue options (rq): not sent to the worker as part of the payload.
    queue: str | None = Field(
        default=None, pattern=QUEUE_NAME_PATTERN, description="queue name (default: producer's)"
    )
    at_front: bool = Field(default=False, description="enqueue at the head of the queue (priority)")
    job_timeout: int | None = Field(default=None, gt=0, description="seconds a job may run once started")
    result_ttl: int | None = Field(
        default=None, ge=-1, description="seconds the result is kept (-1: forever)"
    )
    retries: int = Field(default=0, ge=0, le=100, description="re-runs after a failure or a worker crash")

    @field_validator("agent_id")
    @classmethod
    def _agent_id_is_safe(cls, value: str | None) -> str | None:
        problem = None if value is None else agent_id_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value

    @field_validator("messages")
    @classmethod
    def _messages_fit_one_prompt(cls, value: list[ChatMessage] | None) -> list[ChatMessage] | None:
        total = sum(len(message.content) for message in value or ())
        if total > MAX_PROMPT_CHARS:
            raise ValueError(f"messages hold {total:,} characters in all, the limit is {MAX_PROMPT_CHARS:,}")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: list[str]) -> list[str]:
        for item in value:
            if not item or len(item) > 256:
                raise ValueError("each stop string must have 1 to 256 characters")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_is_json(cls, value: dict[str, Any]) -> dict[str, Any]:
        try:
            encoded = json.dumps(value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"metadata must be JSON-serializable: {exc}") from None
        if len(encoded) > MAX_METADATA_BYTES:
            raise ValueError(f"metadata is {len(encoded)} bytes as JSON, the limit is {MAX_METADATA_BYTES}")
        return value

    @model_validator(mode="after")
    def _prompt_xor_messages(self) -> GenerationRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        return self

    def job_payload(self) -> dict[str, Any]:
        """The JSON dict rq carries to the worker: the generation fields, queue options left out."""
        return self.model_dump(mode="json", exclude=set(QUEUE_OPTION_FIELDS), exclude_none=True)


class Usage(BaseModel):
    prompt_tokens: int
    reused_tokens: int = Field(description="prompt tokens whose KV came from the agent's saved cache")
    prefilled_tokens: int = Field(description="prompt tokens run through the model for this job")
    generated_tokens: int


class Timings(BaseModel):
    """Seconds, measured by the worker from the job's `enqueued_at` (rq)."""

    queued_s: float = Field(description="enqueue until the job entered the engine (incl. cache load)")
    time_to_first_token_s: float | None = Field(description="enqueue until the first generated token")
    total_s: float = Field(description="enqueue until the result was ready")
    cache_load_s: float = Field(default=0.0, description="reading the agent's cache from the store")
    engine_time_to_first_token_s: float | None = Field(
        default=None,
        description="the engine's own part: from its submit() to the step() that returned the first token",
    )


class GenerationResult(BaseModel):
    """The rq return value of a finished job (stored as JSON)."""

    job_id: str
    agent_id: str | None
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    metadata: dict[str, Any] = Field(default_factory=dict)
    model: str = ""
    worker: str = ""
