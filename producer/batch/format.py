"""OpenAI Batch API lines in and out: parse request lines into kvrq requests, format result lines.

A file prepared for the OpenAI Batch API must run here unchanged, so the body stays in OpenAI's shape and
kvrq's one extension (the agent whose cache a line resumes) sits at the top level of the line, next to
`custom_id`: `{"custom_id": "t1", "method": "POST", "url": "/v1/chat/completions", "body": {...},
"kvrq": {"agent_id": "a1"}}`. Output lines follow the Batch output shape and add a `kvrq` object (input line
number, agent, job id, cache reuse) that OpenAI readers ignore. The body inside a line and the response
body inside an output line are producer/openai_shapes/'s, as `kvrq serve`'s are.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ValidationError

from producer.models import GenerationRequest
from producer.openai_shapes.answers import response_body
from producer.openai_shapes.bodies import (
    CHAT_URL,
    COMPLETIONS_URL,
    DEFAULT_MODEL_NAME,
    URLS,
    BodyError,
    chat_request,
    completion_request,
    validation_message,
)
from producer.wire.protocol import ErrorCode

LINE_FIELDS = frozenset({"custom_id", "method", "url", "body", "kvrq"})
KVRQ_FIELDS = frozenset({"agent_id"})

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
    try:
        request = chat_request(body) if url == CHAT_URL else completion_request(body)
    except BodyError as exc:
        raise LineError("invalid_request", exc.message) from None
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


def _names(names: Iterable[str]) -> str:
    return ", ".join(sorted(names))


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
