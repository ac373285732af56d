"""OpenAI request bodies (chat and completions) to GenerationRequest fields: one mapping, one set of checks.

`kvrq batch run` (an OpenAI Batch line's `body`) and `kvrq serve` (a POST's body) both take bodies in
OpenAI's shape; a body that runs in one runs in the other, because both call these. An unknown field,
or one kvrq cannot honour at a value that changes the answer, is refused (BodyError), never dropped.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
URLS = (CHAT_URL, COMPLETIONS_URL)
DEFAULT_MODEL_NAME = "kvrq"
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

# Body fields kvrq maps onto a GenerationRequest, per endpoint.
COMMON_FIELDS = frozenset({"model", "max_tokens", "temperature", "top_p", "seed", "stop"})
#: Body fields that pass to the request as they are (GenerationRequest checks them).
PASSED_FIELDS = frozenset(
    {
        "top_k",
        "min_p",
        "repetition_penalty",
        "repetition_context_size",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
    }
)
CHAT_PASSED_FIELDS = PASSED_FIELDS | {
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    "chat_template_kwargs",
}
CHAT_FIELDS = COMMON_FIELDS | CHAT_PASSED_FIELDS | {"messages", "max_completion_tokens"}
COMPLETION_FIELDS = COMMON_FIELDS | PASSED_FIELDS | {"prompt", "logprobs"}  # logprobs: the top count here
# OpenAI fields that do not change what is generated: accepted and dropped.
IGNORED_FIELDS = frozenset({"user", "store", "metadata", "service_tier"})
# OpenAI fields kvrq cannot honour: accepted only at their neutral value, so no line silently means less.
NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "n": (1, None),
    "best_of": (1, None),
    "stream": (False, None),
    "echo": (False, None),
    "suffix": (None, ""),
}
CHAT_ROLES = {"developer": "system"}  # OpenAI's newer name for the system role


class BodyError(ValueError):
    """Why a body cannot run; `message` names the field (as `body.<field>`)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def _check_body_fields(body: dict[str, Any], allowed: frozenset[str]) -> None:
    for name, value in body.items():
        if name in allowed or name in IGNORED_FIELDS:
            continue
        if name in NEUTRAL_VALUES:
            if value not in NEUTRAL_VALUES[name]:
                raise BodyError(f"body.{name}={json.dumps(value)} is not supported by kvrq")
            continue
        raise BodyError(f"unknown field 'body.{name}'")


def _sampling(body: dict[str, Any], default_max_tokens: int | None) -> dict[str, Any]:
    """Sampling fields with OpenAI's defaults (temperature 1, top_p 1): the file was written for them."""
    out: dict[str, Any] = {
        "temperature": 1.0 if body.get("temperature") is None else body["temperature"],
        "top_p": 1.0 if body.get("top_p") is None else body["top_p"],
    }
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = default_max_tokens
    if max_tokens is not None:
        out["max_tokens"] = max_tokens
    if body.get("seed") is not None:
        out["seed"] = body["seed"]
    stop = body.get("stop")
    if isinstance(stop, str):
        out["stop"] = [stop]
    elif stop is not None:
        out["stop"] = stop
    return out


def chat_request(body: dict[str, Any]) -> dict[str, Any]:
    _check_body_fields(body, CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BodyError("body.messages must be a non-empty list for /v1/chat/completions")
    request = _sampling(body, None)
    request.update(_passed(body, CHAT_PASSED_FIELDS))
    request["messages"] = [_message(i, m) for i, m in enumerate(messages)]
    return request


def _passed(body: dict[str, Any], names: frozenset[str]) -> dict[str, Any]:
    return {name: body[name] for name in sorted(names) if body.get(name) is not None}


def _message(index: int, message: Any) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise BodyError(f"body.messages[{index}] must be an object with 'role' and 'content'")
    role = message.get("role")
    if not isinstance(role, str):
        raise BodyError(f"body.messages[{index}].role must be a string")
    unknown = sorted(set(message) - MESSAGE_FIELDS)
    if unknown:
        raise BodyError(f"body.messages[{index}] has unsupported field(s) {', '.join(unknown)}")
    out = {name: message[name] for name in sorted(MESSAGE_FIELDS) if message.get(name) is not None}
    out["role"] = CHAT_ROLES.get(role, role)
    content = message.get("content")
    if content is not None or not message.get("tool_calls"):
        out["content"] = _content(index, content)
    return out


MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "reasoning"})


def _content(index: int, content: Any) -> str:
    """Message content as text: a string, or a list of text parts joined (images and audio are refused)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BodyError(f"body.messages[{index}]: content part {kind!r} is not supported")
            texts.append(part["text"])
        return "".join(texts)
    raise BodyError(f"body.messages[{index}].content must be a string or a list of text parts")


def completion_request(body: dict[str, Any]) -> dict[str, Any]:
    _check_body_fields(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise BodyError("body.prompt must be one string for /v1/completions")
    request = _sampling(body, COMPLETIONS_DEFAULT_MAX_TOKENS)
    request.update(_passed(body, PASSED_FIELDS))
    top = body.get("logprobs")  # /v1/completions: the number of most likely tokens to return, 0 to 5
    if top is not None:
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 5:
            raise BodyError(f"body.logprobs must be an integer in [0, 5], got {json.dumps(top)}")
        request.update(logprobs=True, top_logprobs=top)
    request["prompt"] = prompt
    return request


def validation_message(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:3]:
        where = ".".join(str(p) for p in err.get("loc", ())) or "request"
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    return "; ".join(parts)
