"""OpenAI Batch API lines in and out: parse request lines into kvrq requests, format result lines.

A file prepared for the OpenAI Batch API must run here unchanged, so the body stays in OpenAI's shape and
kvrq's one extension (the agent whose cache a line resumes) sits at the top level of the line, next to
`custom_id`: `{"custom_id": "t1", "method": "POST", "url": "/v1/chat/completions", "body": {...},
"kvrq": {"agent_id": "a1"}}`. Output lines follow the Batch output shape and add a `kvrq` object (input line
number, agent, job id, cache reuse) that OpenAI readers ignore.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ValidationError

from producer.models import GenerationRequest
from producer.wire.protocol import ErrorCode

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
URLS = (CHAT_URL, COMPLETIONS_URL)
DEFAULT_MODEL_NAME = "kvrq"
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

LINE_FIELDS = frozenset({"custom_id", "method", "url", "body", "kvrq"})
KVRQ_FIELDS = frozenset({"agent_id"})
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

#: `error.code` of an output line (ours: OpenAI's Batch output leaves the code to the endpoint's errors).
LineErrorCode = Literal[
    "invalid_json",
    "invalid_request",
    "unsupported_url",
    "duplicate_custom_id",
    "context_length_exceeded",
    "job_timeout",
    "worker_crashed",
    "job_failed",
    "job_canceled",
    "job_lost",
]
#: A failed job's line code, from the ErrorCode the worker recorded (protocol.py); others: job_failed.
_LINE_CODE_OF_JOB_ERROR: dict[str, LineErrorCode] = {
    ErrorCode.INVALID_REQUEST: "invalid_request",
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: "context_length_exceeded",
    ErrorCode.TIMEOUT: "job_timeout",
    ErrorCode.WORKER_CRASHED: "worker_crashed",
}


@dataclass(frozen=True)
class BatchRequest:
    """One valid input line, ready to enqueue as a kvrq job."""

    line: int  # 1-based line number in the input file
    custom_id: str
    url: str
    model: str
    agent_id: str | None
    request: dict[str, Any]  # GenerationRequest fields (plain JSON), validated

    @property
    def key(self) -> str:
        return output_key(self.custom_id, self.line)


@dataclass(frozen=True)
class BadLine:
    """An input line that cannot run; it becomes an `error` output line without reaching a worker."""

    line: int
    custom_id: str | None  # None when the line has no usable (or a duplicate) custom_id
    code: LineErrorCode
    message: str

    @property
    def key(self) -> str:
        return output_key(self.custom_id, self.line)


ParsedLine = BatchRequest | BadLine


class LineError(ValueError):
    """Why one line was rejected; carries the OpenAI-style error code."""

    def __init__(self, code: LineErrorCode, message: str) -> None:
        super().__init__(message)
        self.code: LineErrorCode = code
        self.message = message


def output_key(custom_id: str | None, line: int) -> str:
    """The resume key of a line: its custom_id, or its line number when it has none usable."""
    return f"id:{custom_id}" if custom_id is not None else f"line:{line}"


def key_of_output(record: Mapping[str, Any]) -> str | None:
    """The resume key of an output line already written (None for a line this module did not write)."""
    custom_id = record.get("custom_id")
    if isinstance(custom_id, str):
        return output_key(custom_id, 0)
    ext = record.get("kvrq")
    if isinstance(ext, Mapping) and isinstance(ext.get("line"), int):
        return output_key(None, int(ext["line"]))
    return None


def parse_lines(lines: Iterable[str | bytes]) -> list[ParsedLine]:
    """Parse every non-blank line; a custom_id seen before makes the later line a `duplicate_custom_id` error.

    The first line to claim a custom_id keeps it even when that line is itself bad, so every custom_id
    appears exactly once in the output.
    """
    parsed: list[ParsedLine] = []
    first_line: dict[str, int] = {}
    for index, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        item = _decode_and_parse(index, raw)
        custom_id = item.custom_id
        if custom_id is not None:
            if custom_id in first_line:
                item = BadLine(
                    index,
                    None,
                    "duplicate_custom_id",
                    f"custom_id {custom_id!r} is already used on line {first_line[custom_id]}",
                )
            else:
                first_line[custom_id] = index
        parsed.append(item)
    return parsed


def _decode_and_parse(line: int, raw: str | bytes) -> ParsedLine:
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            return BadLine(line, None, "invalid_json", f"line {line} is not UTF-8 (byte {exc.start})")
    return parse_line(line, raw)


def parse_line(line: int, text: str) -> ParsedLine:
    """Parse one input line; never raises: a bad line comes back as a BadLine."""
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        return BadLine(
            line, None, "invalid_json", f"line {line} is not valid JSON: {exc.msg} (column {exc.colno})"
        )
    if not isinstance(record, dict):
        return BadLine(line, None, "invalid_json", f"line {line} is not a JSON object")
    custom_id = record.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return BadLine(line, None, "invalid_request", f"line {line}: 'custom_id' must be a non-empty string")
    try:
        return _parse_record(line, custom_id, record)
    except LineError as exc:
        return BadLine(line, custom_id, exc.code, exc.message)


def _parse_record(line: int, custom_id: str, record: dict[str, Any]) -> BatchRequest:
    unknown = sorted(set(record) - LINE_FIELDS)
    if unknown:
        raise LineError(
            "invalid_request", f"unknown field(s) {', '.join(unknown)} (allowed: {_names(LINE_FIELDS)})"
        )
    method = record.get("method", "POST")
    if method != "POST":
        raise LineError("invalid_request", f"'method' must be \"POST\", not {method!r}")
    url = record.get("url")
    if url is None:
        raise LineError("invalid_request", "missing 'url' (/v1/chat/completions or /v1/completions)")
    if url not in URLS:
        raise LineError(
            "unsupported_url", f"url {url!r} is not supported (use {CHAT_URL} or {COMPLETIONS_URL})"
        )
    body = record.get("body")
    if body is None:
        raise LineError("invalid_request", "missing 'body'")
    if not isinstance(body, dict):
        raise LineError("invalid_request", "'body' must be a JSON object")
    agent_id = _agent_id(record.get("kvrq"))
    request = chat_request(body) if url == CHAT_URL else completion_request(body)
    if agent_id is not None:
        request["agent_id"] = agent_id
    request["metadata"] = {"custom_id": custom_id}
    try:
        GenerationRequest.model_validate(request)
    except ValidationError as exc:
        raise LineError("invalid_request", validation_message(exc)) from None
    model = body.get("model")
    return BatchRequest(
        line=line,
        custom_id=custom_id,
        url=url,
        model=model if isinstance(model, str) and model else DEFAULT_MODEL_NAME,
        agent_id=agent_id,
        request=request,
    )


def _agent_id(ext: Any) -> str | None:
    if ext is None:
        return None
    if not isinstance(ext, dict):
        raise LineError("invalid_request", "'kvrq' must be an object like {'agent_id': 'a1'}")
    unknown = sorted(set(ext) - KVRQ_FIELDS)
    if unknown:
        raise LineError(
            "invalid_request", f"unknown field(s) in 'kvrq': {', '.join(unknown)} (allowed: agent_id)"
        )
    agent_id = ext.get("agent_id")
    if agent_id is not None and (not isinstance(agent_id, str) or not agent_id):
        raise LineError("invalid_request", "'kvrq.agent_id' must be a non-empty string")
    return agent_id


def _check_body_fields(body: dict[str, Any], allowed: frozenset[str]) -> None:
    for name, value in body.items():
        if name in allowed or name in IGNORED_FIELDS:
            continue
        if name in NEUTRAL_VALUES:
            if value not in NEUTRAL_VALUES[name]:
                raise LineError(
                    "invalid_request", f"body.{name}={json.dumps(value)} is not supported by kvrq"
                )
            continue
        raise LineError("invalid_request", f"unknown field 'body.{name}'")


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
        raise LineError("invalid_request", "body.messages must be a non-empty list for /v1/chat/completions")
    request = _sampling(body, None)
    request.update(_passed(body, CHAT_PASSED_FIELDS))
    request["messages"] = [_message(i, m) for i, m in enumerate(messages)]
    return request


def _passed(body: dict[str, Any], names: frozenset[str]) -> dict[str, Any]:
    return {name: body[name] for name in sorted(names) if body.get(name) is not None}


def _message(index: int, message: Any) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise LineError(
            "invalid_request", f"body.messages[{index}] must be an object with 'role' and 'content'"
        )
    role = message.get("role")
    if not isinstance(role, str):
        raise LineError("invalid_request", f"body.messages[{index}].role must be a string")
    unknown = sorted(set(message) - MESSAGE_FIELDS)
    if unknown:
        raise LineError(
            "invalid_request", f"body.messages[{index}] has unsupported field(s) {', '.join(unknown)}"
        )
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
                raise LineError(
                    "invalid_request", f"body.messages[{index}]: content part {kind!r} is not supported"
                )
            texts.append(part["text"])
        return "".join(texts)
    raise LineError(
        "invalid_request", f"body.messages[{index}].content must be a string or a list of text parts"
    )


def completion_request(body: dict[str, Any]) -> dict[str, Any]:
    _check_body_fields(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise LineError("invalid_request", "body.prompt must be one string for /v1/completions")
    request = _sampling(body, COMPLETIONS_DEFAULT_MAX_TOKENS)
    request.update(_passed(body, PASSED_FIELDS))
    top = body.get("logprobs")  # /v1/completions: the number of most likely tokens to return, 0 to 5
    if top is not None:
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 5:
            raise LineError(
                "invalid_request", f"body.logprobs must be an integer in [0, 5], got {json.dumps(top)}"
            )
        request.update(logprobs=True, top_logprobs=top)
    request["prompt"] = prompt
    return request


def validation_message(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:3]:
        where = ".".join(str(p) for p in err.get("loc", ())) or "request"
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    return "; ".join(parts)


def _names(names: Iterable[str]) -> str:
    return ", ".join(sorted(names))


# ---- output lines ----------------------------------------------------------------------------------


def success_line(
    item: BatchRequest, job_id: str, result: Mapping[str, Any], created: int | None = None
) -> dict:
    """An output line for a finished job: `response.body` is a chat.completion or a text_completion."""
    usage = result.get("usage") or {}
    prompt_tokens = int(usage.get("prompt_tokens", 0))
    generated = int(usage.get("generated_tokens", 0))
    reused = int(usage.get("reused_tokens", 0))
    created = int(time.time()) if created is None else created
    body = response_body(item.url, job_id, item.model, result, created)
    return {
        "id": f"batch_req_{job_id}",
        "custom_id": item.custom_id,
        "response": {"status_code": 200, "request_id": job_id, "body": body},
        "error": None,
        "kvrq": {
            "line": item.line,
            "agent_id": item.agent_id,
            "job_id": job_id,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "reused_tokens": reused,
                "prefilled_tokens": int(usage.get("prefilled_tokens", 0)),
                "generated_tokens": generated,
            },
            "timings": result.get("timings"),
            "worker": result.get("worker"),
        },
    }


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


def error_line(
    run_id: str,
    line: int,
    custom_id: str | None,
    code: LineErrorCode,
    message: str,
    job_id: str | None = None,
    agent_id: str | None = None,
) -> dict:
    """An output line for a line that produced no completion (bad input or a failed job)."""
    return {
        "id": f"batch_req_{job_id or f'{run_id}_line{line}'}",
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
        "kvrq": {"line": line, "agent_id": agent_id, "job_id": job_id},
    }


def bad_line_output(run_id: str, bad: BadLine) -> dict:
    return error_line(run_id, bad.line, bad.custom_id, bad.code, bad.message)


def failed_job_code(code: str | None) -> LineErrorCode:
    """The output line's code for a failed job, from the job's ErrorCode (never from its error text)."""
    return _LINE_CODE_OF_JOB_ERROR.get(code or ErrorCode.INTERNAL, "job_failed")
