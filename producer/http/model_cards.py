"""/v1/models entries with the limits clients size themselves by, and the max_tokens clamp report.

A model's context length is what its workers publish (protocol.CONTEXT_FIELD, the smallest among
them). Clients read it under different names, so an entry carries each: `context_length` (OpenRouter,
LM Studio), `max_model_len` (vLLM), `context_window` / `max_context_window` (Codex's model metadata),
`limit.context` / `limit.output` (opencode's), Anthropic's `max_input_tokens` / `max_tokens`. An
answer may use all of the context the prompt leaves (kvrq serve clamps max_tokens to it), so the
output limit is the context too.
"""

from __future__ import annotations

from typing import Any

from producer.http.pools import Pool
from producer.models import GenerationResult

#: The response header naming the max_tokens an answer ran with when it was cut to the context.
CLAMP_HEADER = "x-kvrq-max-tokens-clamped"


def openai_model(pool: Pool) -> dict[str, Any]:
    card: dict[str, Any] = {
        "id": pool.model,
        "object": "model",
        "created": 0,
        "owned_by": "kvrq",
        "kvrq": {"queue": pool.queue, "workers": pool.workers, "context_length": pool.context},
    }
    if pool.context is not None:
        card.update(
            context_length=pool.context,
            max_model_len=pool.context,
            context_window=pool.context,
            max_context_window=pool.context,
            max_output_tokens=pool.context,
            limit={"context": pool.context, "output": pool.context},
        )
    return card


def anthropic_model(pool: Pool) -> dict[str, Any]:
    card: dict[str, Any] = {
        "type": "model",
        "id": pool.model,
        "display_name": pool.model,
        "created_at": "1970-01-01T00:00:00Z",
    }
    if pool.context is not None:
        card.update(max_input_tokens=pool.context, max_tokens=pool.context)
    return card


def clamped_to(pool: Pool, requested: int | None, result: GenerationResult | None) -> int | None:
    """The max_tokens the job ran with when the context cut the `requested` one, else None."""
    return clamp_of(pool, requested, None if result is None else result.usage.prompt_tokens)


def clamp_of(pool: Pool, requested: int | None, prompt_tokens: int | None) -> int | None:
    """The max_tokens a prompt of `prompt_tokens` runs with when the context cuts `requested`, else None.
    A stream knows its prompt's length before its first byte: the worker publishes it in the job's
    progress (meta) when it admits the job, before its first token."""
    if pool.context is None or requested is None or prompt_tokens is None:
        return None
    room = pool.context - prompt_tokens
    return room if 0 < room < requested else None


def progress_prompt_tokens(meta: dict[str, Any]) -> int | None:
    """The prompt length the worker published in a job's meta (`progress.prompt_tokens`), if any."""
    progress = meta.get("progress")
    tokens = progress.get("prompt_tokens") if isinstance(progress, dict) else None
    return tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else None
