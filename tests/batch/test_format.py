"""Parsing OpenAI Batch request lines and formatting output lines (no Redis)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from producer.batch.format import (
    BadLine,
    BatchRequest,
    error_line,
    failed_job_code,
    key_of_output,
    parse_line,
    parse_lines,
    success_line,
)
from producer.models import GenerationRequest
from producer.wire.protocol import ErrorCode


def chat_line(custom_id: str = "r1", **body: Any) -> dict[str, Any]:
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def parse(record: Any, line: int = 1) -> BatchRequest | BadLine:
    return parse_line(line, record if isinstance(record, str) else json.dumps(record))


def test_chat_line_maps_to_a_generation_request_with_openai_defaults() -> None:
    item = parse(chat_line(model="gpt-4o-mini", max_tokens=7, seed=3, stop="\n"))
    assert isinstance(item, BatchRequest)
    assert item.custom_id == "r1" and item.model == "gpt-4o-mini" and item.agent_id is None
    assert item.request == {
        "messages": [{"role": "user", "content": "hi"}],
        "temperature": 1.0,  # OpenAI's default, not kvrq's greedy default: the file was written for OpenAI
        "top_p": 1.0,
        "max_tokens": 7,
        "seed": 3,
        "stop": ["\n"],
        "metadata": {"custom_id": "r1"},
    }


def test_agent_id_comes_from_the_top_level_kvrq_extension() -> None:
    record = chat_line(temperature=0)
    record["kvrq"] = {"agent_id": "agent-1"}
    item = parse(record)
    assert isinstance(item, BatchRequest)
    assert item.agent_id == "agent-1" and item.request["agent_id"] == "agent-1"
    assert item.request["temperature"] == 0


def test_max_completion_tokens_wins_and_text_parts_are_joined() -> None:
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    item = parse(chat_line(messages=messages, max_tokens=50, max_completion_tokens=5, n=1, stream=False))
    assert isinstance(item, BatchRequest)
    assert item.request["max_tokens"] == 5
    assert item.request["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
    ]


def test_completions_line_takes_a_prompt_and_openais_16_token_default() -> None:
    record = {"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": ["Once"]}}
    item = parse(record)
    assert isinstance(item, BatchRequest)
    assert item.url == "/v1/completions" and item.model == "kvrq"
    assert item.request["prompt"] == "Once" and item.request["max_tokens"] == 16


@pytest.mark.parametrize(
    ("text", "code", "fragment", "custom_id"),
    [
        ("{not json", "invalid_json", "not valid JSON", None),
        ("[1, 2]", "invalid_json", "not a JSON object", None),
        (
            json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}),
            "invalid_request",
            "custom_id",
            None,
        ),
        (json.dumps({**chat_line(), "extra": 1}), "invalid_request", "unknown field(s) extra", "r1"),
        (
            json.dumps({"custom_id": "r1", "url": "/v1/chat/completions"}),
            "invalid_request",
            "missing 'body'",
            "r1",
        ),
        (json.dumps({**chat_line(), "url": "/v1/embeddings"}), "unsupported_url", "/v1/embeddings", "r1"),
        (json.dumps({**chat_line(), "method": "GET"}), "invalid_request", "method", "r1"),
        (json.dumps(chat_line(frobnicate=True)), "invalid_request", "body.frobnicate", "r1"),
        (json.dumps(chat_line(n=2)), "invalid_request", "body.n=2", "r1"),
        (json.dumps(chat_line(functions=[])), "invalid_request", "body.functions", "r1"),
        (json.dumps(chat_line(top_k=-1)), "invalid_request", "top_k", "r1"),
        (
            json.dumps(chat_line(tools=[{"type": "function", "function": {}}])),
            "invalid_request",
            "name",
            "r1",
        ),
        (json.dumps(chat_line(top_logprobs=2)), "invalid_request", "top_logprobs needs logprobs", "r1"),
        (
            json.dumps(
                chat_line(
                    response_format={
                        "type": "json_schema",
                        "json_schema": {"name": "x", "schema": {"type": 1}},
                    }
                )
            ),
            "invalid_request",
            "invalid JSON schema",
            "r1",
        ),
        (json.dumps(chat_line(messages=[])), "invalid_request", "non-empty list", "r1"),
        (
            json.dumps(
                chat_line(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
            ),
            "invalid_request",
            "'image_url' is not supported",
            "r1",
        ),
        (json.dumps(chat_line(temperature=-1)), "invalid_request", "temperature", "r1"),
        (json.dumps({**chat_line(), "kvrq": {"agent_id": "bad id!"}}), "invalid_request", "agent_id", "r1"),
        (json.dumps({**chat_line(), "kvrq": {"agent": "a"}}), "invalid_request", "in 'kvrq'", "r1"),
    ],
)
def test_bad_lines_become_errors_with_a_clear_message(
    text: str, code: str, fragment: str, custom_id: str | None
) -> None:
    item = parse(text, line=4)
    assert isinstance(item, BadLine), item
    assert item.code == code and fragment in item.message
    assert item.custom_id == custom_id and item.line == 4


def test_parse_lines_skips_blank_lines_flags_duplicates_and_non_utf8() -> None:
    lines = [
        json.dumps(chat_line("a")).encode(),
        b"",
        b"   ",
        json.dumps(chat_line("b")).encode(),
        json.dumps(chat_line("a")).encode(),
        b'{"custom_id": "\xff"}',
    ]
    items = parse_lines(lines)
    assert [item.line for item in items] == [1, 4, 5, 6]
    assert [type(item).__name__ for item in items] == ["BatchRequest", "BatchRequest", "BadLine", "BadLine"]
    duplicate = items[2]
    assert isinstance(duplicate, BadLine) and duplicate.code == "duplicate_custom_id"
    assert duplicate.custom_id is None and "line 1" in duplicate.message  # each custom_id once in the output
    assert isinstance(items[3], BadLine) and "UTF-8" in items[3].message


def test_a_bad_line_keeps_its_custom_id_and_a_later_duplicate_of_it_is_an_error() -> None:
    items = parse_lines([json.dumps({**chat_line("x"), "url": "/nope"}), json.dumps(chat_line("x"))])
    assert isinstance(items[0], BadLine) and items[0].custom_id == "x"
    assert isinstance(items[1], BadLine) and items[1].code == "duplicate_custom_id"


RESULT = {
    "job_id": "j",
    "agent_id": "a1",
    "text": "Paris.",
    "token_ids": [1, 2],
    "finish_reason": "stop",
    "usage": {"prompt_tokens": 30, "reused_tokens": 20, "prefilled_tokens": 10, "generated_tokens": 2},
    "timings": {"queued_s": 0.1, "time_to_first_token_s": 0.2, "total_s": 0.3},
    "metadata": {},
}


def test_success_line_is_a_chat_completion_with_usage_and_cached_tokens() -> None:
    item = parse({**chat_line("q1"), "kvrq": {"agent_id": "a1"}}, line=3)
    assert isinstance(item, BatchRequest)
    out = success_line(item, "job-1", RESULT, created=123)
    assert out["custom_id"] == "q1" and out["error"] is None and out["id"] == "batch_req_job-1"
    response = out["response"]
    assert response["status_code"] == 200 and response["request_id"] == "job-1"
    body = response["body"]
    assert body["object"] == "chat.completion" and body["created"] == 123
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Paris."},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    assert body["usage"] == {
        "prompt_tokens": 30,
        "completion_tokens": 2,
        "total_tokens": 32,
        "prompt_tokens_details": {"cached_tokens": 20},
    }
    assert out["kvrq"]["line"] == 3 and out["kvrq"]["agent_id"] == "a1"
    assert out["kvrq"]["usage"]["reused_tokens"] == 20
    assert key_of_output(json.loads(json.dumps(out))) == item.key


def test_success_line_for_completions_is_a_text_completion() -> None:
    item = parse({"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "x", "model": "m"}})
    assert isinstance(item, BatchRequest)
    body = success_line(item, "job-2", {**RESULT, "finish_reason": "length"})["response"]["body"]
    assert body["object"] == "text_completion" and body["model"] == "m"
    assert body["choices"][0]["text"] == "Paris." and body["choices"][0]["finish_reason"] == "length"


def test_error_lines_are_keyed_by_custom_id_or_by_line_number() -> None:
    with_id = error_line("run", 5, "z", "job_failed", "boom", job_id="run_c_z")
    assert with_id["response"] is None and with_id["error"] == {"code": "job_failed", "message": "boom"}
    assert key_of_output(with_id) == "id:z"
    anonymous = error_line("run", 9, None, "invalid_json", "bad")
    assert anonymous["custom_id"] is None and anonymous["id"] == "batch_req_run_line9"
    assert key_of_output(anonymous) == "line:9"
    assert key_of_output({"foo": 1}) is None


def test_a_failed_jobs_line_code_follows_its_error_code() -> None:
    assert failed_job_code(ErrorCode.CONTEXT_LENGTH_EXCEEDED) == "context_length_exceeded"
    assert failed_job_code(ErrorCode.INVALID_REQUEST) == "invalid_request"
    assert failed_job_code(ErrorCode.TIMEOUT) == "job_timeout"
    assert failed_job_code(ErrorCode.WORKER_CRASHED) == "worker_crashed"
    for code in (ErrorCode.ENGINE_ERROR, ErrorCode.INTERNAL, None, "a-code-from-a-newer-worker"):
        assert failed_job_code(code) == "job_failed"


AGENT_BODY: dict[str, Any] = {
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
    ],
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
    "tool_choice": "auto",
    "top_k": 20,
    "min_p": 0.05,
    "repetition_penalty": 1.1,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.5,
    "logit_bias": {"42": -100},
    "logprobs": True,
    "top_logprobs": 2,
    "chat_template_kwargs": {"enable_thinking": False},
}


def test_agent_fields_of_a_chat_line_reach_the_request() -> None:
    item = parse(chat_line(**AGENT_BODY))
    assert isinstance(item, BatchRequest)
    request = GenerationRequest.model_validate(item.request)
    assert request.tools is not None and request.tools[0].function.name == "get_weather"
    assert request.messages is not None and request.messages[1].tool_calls is not None
    assert request.messages[2].tool_call_id == "c1"
    assert (request.top_k, request.logit_bias_ids, request.top_logprobs) == (20, {42: -100.0}, 2)
    assert request.chat_template_kwargs == {"enable_thinking": False}


def test_completions_logprobs_is_the_top_count() -> None:
    item = parse({"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "x", "logprobs": 2}})
    assert isinstance(item, BatchRequest)
    assert (item.request["logprobs"], item.request["top_logprobs"]) == (True, 2)
    bad = parse({"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "x", "logprobs": 9}})
    assert isinstance(bad, BadLine) and "body.logprobs must be an integer in [0, 5]" in bad.message


LOGPROBS = [
    {
        "token": "Hi",
        "token_id": 5,
        "logprob": -0.1,
        "bytes": [72, 105],
        "top_logprobs": [{"token": "Hi", "token_id": 5, "logprob": -0.1, "bytes": [72, 105]}],
    }
]
CALL = {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}


def test_success_line_carries_tool_calls_reasoning_and_logprobs_in_openais_shape() -> None:
    item = parse(chat_line(**AGENT_BODY))
    assert isinstance(item, BatchRequest)
    result = {
        **RESULT,
        "text": "",
        "finish_reason": "tool_calls",
        "tool_calls": [CALL],
        "reasoning": "Rome, then.",
        "logprobs": LOGPROBS,
    }
    (choice,) = success_line(item, "j", result)["response"]["body"]["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [CALL],
        "reasoning": "Rome, then.",
    }
    assert choice["logprobs"] == {
        "content": [
            {
                "token": "Hi",
                "logprob": -0.1,
                "bytes": [72, 105],
                "top_logprobs": [{"token": "Hi", "logprob": -0.1, "bytes": [72, 105]}],
            }
        ]
    }

    completion = parse({"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "x", "logprobs": 1}})
    assert isinstance(completion, BatchRequest)
    (choice,) = success_line(completion, "j", {**RESULT, "text": "Hi", "logprobs": LOGPROBS})["response"][
        "body"
    ]["choices"]
    assert choice["logprobs"] == {
        "tokens": ["Hi"],
        "token_logprobs": [-0.1],
        "top_logprobs": [{"Hi": -0.1}],
        "text_offset": [0],
    }


def test_the_openai_shapes_belong_to_neither_door() -> None:
    """producer/openai_shapes/ is shared by `kvrq serve` and `kvrq batch run`: it imports neither."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    imported = [
        node.module
        for path in sorted((root / "producer" / "openai_shapes").glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module
    ]
    assert "producer.openai_shapes.bodies" in imported
    assert [m for m in imported if m.startswith(("producer.http", "producer.batch"))] == []
