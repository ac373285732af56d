"""kvrq results in OpenAI's response shapes: chat.completion, text_completion, usage, logprobs.

Both `kvrq serve` (a live answer) and `kvrq batch run` (an output line's `response.body`) answer with
these, so a result reads the same from either door.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from producer.openai_shapes.bodies import CHAT_URL


def response_body(
    url: str, job_id: str, model: str, result: Mapping[str, Any], created: int
) -> dict[str, Any]:
    """A finished job's result as OpenAI's response body for `url`: a chat.completion or a text_completion."""
    text = str(result.get("text", ""))
    finish_reason = result.get("finish_reason") or "stop"
    logprobs = result.get("logprobs")
    if url == CHAT_URL:
        body: dict[str, Any] = {
            "id": f"chatcmpl-{job_id}",
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": assistant_message(text, result),
                    "logprobs": None
                    if logprobs is None
                    else {"content": [chat_logprob(e) for e in logprobs]},
                    "finish_reason": finish_reason,
                }
            ],
        }
    else:
        body = {
            "id": f"cmpl-{job_id}",
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "text": text,
                    "logprobs": None if logprobs is None else completion_logprobs(logprobs),
                    "finish_reason": finish_reason,
                }
            ],
        }
    body["usage"] = openai_usage(result.get("usage") or {})
    return body


def openai_usage(usage: Mapping[str, Any]) -> dict[str, Any]:
    """A kvrq result's usage in OpenAI's shape: the tokens resumed from cache are `cached_tokens`."""
    prompt_tokens = int(usage.get("prompt_tokens", 0))
    generated = int(usage.get("generated_tokens", 0))
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": generated,
        "total_tokens": prompt_tokens + generated,
        "prompt_tokens_details": {"cached_tokens": int(usage.get("reused_tokens", 0))},
    }


def assistant_message(text: str, result: Mapping[str, Any]) -> dict[str, Any]:
    """OpenAI's assistant message: content None when the answer is tool calls alone; reasoning as
    mlx-lm's server names it."""
    tool_calls = result.get("tool_calls")
    message: dict[str, Any] = {"role": "assistant", "content": None if tool_calls and not text else text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    if result.get("reasoning"):
        message["reasoning"] = result["reasoning"]
    return message


def chat_logprob(entry: Mapping[str, Any]) -> dict[str, Any]:
    """One token of chat.completion `logprobs.content`: token, logprob, bytes, top_logprobs."""
    return {
        "token": entry["token"],
        "logprob": entry["logprob"],
        "bytes": entry.get("bytes"),
        "top_logprobs": [
            {"token": top["token"], "logprob": top["logprob"], "bytes": top.get("bytes")}
            for top in entry.get("top_logprobs") or ()
        ],
    }


def completion_logprobs(entries: list[Mapping[str, Any]]) -> dict[str, Any]:
    """text_completion `logprobs`: parallel lists of tokens, their logprobs, top maps and text offsets."""
    offsets, offset = [], 0
    for entry in entries:
        offsets.append(offset)
        offset += len(entry["token"])
    return {
        "tokens": [entry["token"] for entry in entries],
        "token_logprobs": [entry["logprob"] for entry in entries],
        "top_logprobs": [
            {top["token"]: top["logprob"] for top in entry.get("top_logprobs") or ()} for entry in entries
        ],
        "text_offset": offsets,
    }
