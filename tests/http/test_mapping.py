"""`kvrq serve`: field mappings both ways (OpenAI, Anthropic), stream translators, errors (no Redis)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from producer.client import JobCanceledError, JobFailedError
from producer.http import anthropic_api, openai_api
from producer.http.errors import APIError, flavor_of, from_job_failure
from producer.models import GenerationRequest, GenerationResult
from producer.openai_shapes.bodies import CHAT_URL, COMPLETIONS_URL
from producer.outcome import Replay
from producer.wire.protocol import ErrorCode, StreamEvent
from tests.batch.test_format import LOGPROBS, RESULT

ENTRY = LOGPROBS[0]
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def result(**fields: Any) -> GenerationResult:
    return GenerationResult.model_validate({**RESULT, "job_id": "j1", **fields})


def events(chunks: list[bytes]) -> list[tuple[str | None, Any]]:
    """(event name, data) of SSE bytes; data parsed as JSON unless it is [DONE]."""
    out = []
    for block in b"".join(chunks).decode().split("\n\n"):
        if not block:
            continue
        name, data = None, None
        for line in block.split("\n"):
            key, _, value = line.partition(": ")
            if key == "event":
                name = value
            elif key == "data":
                data = value if value == "[DONE]" else json.loads(value)
        out.append((name, data))
    return out


# ---- OpenAI requests ----------------------------------------------------------------------------


def test_chat_body_maps_every_generation_field() -> None:
    body = {
        "model": "smollm2-135m",
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "in Rome?"}],
            },
        ],
        "max_tokens": 50,
        "max_completion_tokens": 9,
        "temperature": 0.5,
        "top_p": 0.9,
        "seed": 7,
        "stop": "\n",
        "top_k": 40,
        "min_p": 0.05,
        "presence_penalty": 0.1,
        "frequency_penalty": 0.2,
        "repetition_penalty": 1.1,
        "logit_bias": {"42": -5},
        "logprobs": True,
        "top_logprobs": 2,
        "tools": [WEATHER],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "response_format": {"type": "text"},
        "chat_template_kwargs": {"enable_thinking": False},
        "prompt_cache_key": "alice",
        "user": "ignored",
    }
    parsed = openai_api.parse(CHAT_URL, body)
    assert parsed.model == "smollm2-135m" and not parsed.stream
    fields = parsed.fields
    assert fields["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Rome?"},
    ]
    assert fields["max_tokens"] == 9  # max_completion_tokens wins, as at OpenAI
    assert fields["stop"] == ["\n"] and fields["agent_id"] == "alice"
    for name in ("temperature", "top_p", "seed", "top_k", "min_p", "presence_penalty", "frequency_penalty"):
        assert fields[name] == body[name], name
    for name in ("repetition_penalty", "logit_bias", "logprobs", "top_logprobs", "tools", "tool_choice"):
        assert fields[name] == body[name], name
    assert fields["parallel_tool_calls"] is False and fields["response_format"] == {"type": "text"}
    assert fields["chat_template_kwargs"] == {"enable_thinking": False}
    GenerationRequest.model_validate(fields)


def test_chat_defaults_are_openais_and_the_header_names_the_agent() -> None:
    parsed = openai_api.parse(
        CHAT_URL,
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        agent="bob",
    )
    assert parsed.stream and parsed.include_usage
    assert parsed.fields["temperature"] == 1.0 and parsed.fields["agent_id"] == "bob"
    assert "max_tokens" not in parsed.fields  # kvrq's default applies


def test_completion_body_takes_a_prompt_and_a_logprobs_count() -> None:
    parsed = openai_api.parse(COMPLETIONS_URL, {"model": "m", "prompt": ["Once"], "logprobs": 2})
    assert parsed.fields["prompt"] == "Once" and parsed.fields["max_tokens"] == 16
    assert parsed.fields["logprobs"] is True and parsed.fields["top_logprobs"] == 2


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"messages": [{"role": "user", "content": "x"}], "frobnicate": 1}, "unknown field 'frobnicate'"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n=2 is not supported"),
        (
            {"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}},
            "goes with",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "'image_url' is not supported",
        ),
        ({"messages": "hi"}, "messages must be a non-empty list"),
        ({"messages": [{"role": "user", "content": "x"}], "prompt_cache_key": 3}, "prompt_cache_key"),
    ],
)
def test_bad_chat_bodies_are_400_with_the_reason(body: dict[str, Any], says: str) -> None:
    with pytest.raises(APIError) as caught:
        openai_api.parse(CHAT_URL, body)
    assert caught.value.status == 400 and says in caught.value.message


# ---- OpenAI responses ---------------------------------------------------------------------------


def test_chat_response_reports_cached_tokens_tool_calls_reasoning_and_logprobs() -> None:
    parsed = openai_api.parse(CHAT_URL, {"messages": [{"role": "user", "content": "x"}]})
    body = openai_api.response(
        parsed,
        "smollm2-135m",
        result(text="", finish_reason="tool_calls", tool_calls=[CALL], reasoning="Rome.", logprobs=[ENTRY]),
    )
    assert (
        body["id"] == "chatcmpl-j1"
        and body["object"] == "chat.completion"
        and body["model"] == "smollm2-135m"
    )
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [CALL],
        "reasoning": "Rome.",
        "reasoning_content": "Rome.",
    }
    assert choice["logprobs"]["content"][0]["top_logprobs"] == [
        {"token": "Hi", "logprob": -0.1, "bytes": [72, 105]}
    ]
    assert body["usage"] == {
        "prompt_tokens": 30,
        "completion_tokens": 2,
        "total_tokens": 32,
        "prompt_tokens_details": {"cached_tokens": 20},
    }
    assert body["kvrq"]["job_id"] == "j1" and body["kvrq"]["usage"]["reused_tokens"] == 20


def test_a_structured_answer_says_whether_it_is_valid_against_its_whole_schema() -> None:
    check = {
        "valid": False,
        "violation": "$: ['a', 'a'] has non-unique elements",
        "unenforced": ["uniqueItems"],
    }
    parsed = openai_api.parse(CHAT_URL, {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    body = openai_api.response(parsed, "m", result(schema_check=check))
    assert body["kvrq"]["schema_check"] == check
    plain = openai_api.response(parsed, "m", result())
    assert plain["kvrq"]["schema_check"] is None  # no response_format: nothing was checked


def test_chat_stream_is_openais_chunk_sequence() -> None:
    stream = openai_api.ChatStream("j1", "m", include_usage=True, logprobs=True)
    chunks = stream.head()
    for event in [
        StreamEvent("reasoning", text="hmm"),
        StreamEvent("delta", text="Hi", token=5),
        StreamEvent("logprobs", data=ENTRY),
        StreamEvent("tool_call", data=CALL),
        StreamEvent("end", finish_reason="tool_calls"),
    ]:
        chunks += stream.event(event)
    chunks += stream.tail(result())
    sent = [data for _, data in events(chunks)]
    assert sent[-1] == "[DONE]"
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == "chatcmpl-j1" for c in sent[:-1])
    deltas = [c["choices"][0]["delta"] for c in sent[:-2]]
    assert deltas == [
        {"role": "assistant", "content": ""},
        {"reasoning_content": "hmm", "reasoning": "hmm"},
        {"content": "Hi"},
        {"tool_calls": [{"index": 0, **CALL}]},
        {},
    ]
    assert sent[2]["choices"][0]["logprobs"]["content"][0]["token"] == "Hi"  # with its text, one chunk
    assert sent[4]["choices"][0]["finish_reason"] == "tool_calls"
    assert sent[-2]["choices"] == [] and sent[-2]["usage"]["prompt_tokens_details"] == {"cached_tokens": 20}
    assert all(c["usage"] is None for c in sent[:-2])


def test_completion_stream_without_usage_ends_with_done() -> None:
    stream = openai_api.CompletionStream("j1", "m", include_usage=False)
    chunks = (
        stream.head()
        + stream.event(StreamEvent("delta", text="Once"))
        + stream.event(StreamEvent("end", finish_reason="length"))
    )
    sent = [data for _, data in events(chunks + stream.tail(None))]
    assert [c["choices"][0]["text"] for c in sent[:-1]] == ["Once", ""]
    assert sent[1]["choices"][0]["finish_reason"] == "length" and sent[-1] == "[DONE]"
    assert "usage" not in sent[0] and sent[0]["object"] == "text_completion"


# ---- Anthropic ----------------------------------------------------------------------------------


def test_messages_body_maps_blocks_tools_and_samplers() -> None:
    body = {
        "model": "m",
        "max_tokens": 20,
        "system": [{"type": "text", "text": "Be brief."}],
        "messages": [
            {"role": "user", "content": "Weather in Rome?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Call it.", "signature": "s"},
                    {"type": "tool_use", "id": "c1", "name": "get_weather", "input": {"city": "Rome"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "c1",
                        "content": [{"type": "text", "text": "Sun"}],
                    },
                    {"type": "text", "text": "And so?"},
                ],
            },
        ],
        "temperature": 0.2,
        "top_p": 0.9,
        "top_k": 5,
        "stop_sequences": ["END"],
        "tools": [
            {
                "name": "get_weather",
                "description": "Weather",
                "input_schema": WEATHER["function"]["parameters"],
            }
        ],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "metadata": {"user_id": "carol"},
    }
    fields = anthropic_api.parse(body).fields
    assert fields["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [CALL | {"function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}],
            "reasoning": "Call it.",
        },
        {"role": "tool", "tool_call_id": "c1", "content": "Sun"},
        {"role": "user", "content": "And so?"},
    ]
    assert fields["max_tokens"] == 20 and fields["stop"] == ["END"] and fields["agent_id"] == "carol"
    assert (fields["temperature"], fields["top_p"], fields["top_k"]) == (0.2, 0.9, 5)
    assert fields["tools"][0]["function"]["name"] == "get_weather"
    assert fields["tool_choice"] == "required" and fields["parallel_tool_calls"] is False
    GenerationRequest.model_validate(fields)
    named = anthropic_api.parse(
        {**body, "tool_choice": {"type": "tool", "name": "get_weather"}}, agent="dave"
    )
    assert named.fields["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert named.fields["agent_id"] == "dave"  # the header wins over metadata.user_id


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "'max_tokens' is required"),
        (
            {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "'image' block",
        ),
        ({"max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]}, "role 'user', 'assistant' or"),
        (
            {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "frobnicate": "c"},
            "unknown field(s) frobnicate",
        ),
        (  # a hosted tool is left out of the prompt, so forcing it could only give a wrong answer
            {
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "web_search_20250305", "name": "w"}],
                "tool_choice": {"type": "tool", "name": "w"},
            },
            "not among the client tools",
        ),
    ],
)
def test_bad_messages_bodies_are_400_with_the_reason(body: dict[str, Any], says: str) -> None:
    with pytest.raises(APIError) as caught:
        anthropic_api.parse(body)
    assert caught.value.status == 400 and says in caught.value.message


def test_count_tokens_body_needs_no_max_tokens_and_takes_no_sampler() -> None:
    parsed = anthropic_api.parse({"model": "m", "messages": [{"role": "user", "content": "x"}]}, count=True)
    assert parsed.fields == {"messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(APIError):
        anthropic_api.parse({"messages": [{"role": "user", "content": "x"}], "max_tokens": 3}, count=True)


def test_message_response_has_blocks_stop_reason_and_cache_reads() -> None:
    body = anthropic_api.response(
        "m", result(text="On it.", finish_reason="tool_calls", tool_calls=[CALL], reasoning="r")
    )
    assert body["id"] == "msg_j1" and body["type"] == "message" and body["stop_reason"] == "tool_use"
    assert body["content"] == [
        {"type": "thinking", "thinking": "r", "signature": ""},
        {"type": "text", "text": "On it."},
        {"type": "tool_use", "id": "c1", "name": "get_weather", "input": {"city": "Rome"}},
    ]
    assert body["usage"] == {
        "input_tokens": 10,
        "output_tokens": 2,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 20,
    }
    assert anthropic_api.response("m", result(finish_reason="length"))["stop_reason"] == "max_tokens"


def test_message_stream_is_anthropics_event_sequence() -> None:
    stream = anthropic_api.MessageStream("j1", "m")
    chunks = stream.head()
    for event in [
        StreamEvent("reasoning", text="hm"),
        StreamEvent("delta", text="Hel"),
        StreamEvent("delta", text="lo"),
        StreamEvent("logprobs", data=ENTRY),
        StreamEvent("tool_call", data=CALL),
        StreamEvent("end", finish_reason="tool_calls"),
    ]:
        chunks += stream.event(event)
    sent = events(chunks + stream.tail(result()))
    assert all(name == data["type"] for name, data in sent)
    assert [name for name, _ in sent] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",  # the thinking block's signature (empty), as Anthropic streams one
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert [data["index"] for _, data in sent[1:-2]] == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2]
    assert sent[3][1]["delta"] == {"type": "signature_delta", "signature": ""}
    assert sent[6][1]["delta"] == {"type": "text_delta", "text": "Hel"}
    assert sent[9][1]["content_block"] == {"type": "tool_use", "id": "c1", "name": "get_weather", "input": {}}
    assert json.loads(sent[10][1]["delta"]["partial_json"]) == {"city": "Rome"}
    assert sent[-2][1]["delta"]["stop_reason"] == "tool_use"
    assert sent[-2][1]["usage"]["cache_read_input_tokens"] == 20


def test_an_empty_answer_still_streams_one_text_block() -> None:
    stream = anthropic_api.MessageStream("j1", "m")
    names = [
        name for name, _ in events(stream.head() + stream.event(StreamEvent("end", finish_reason="stop")))
    ]
    assert names == ["message_start", "content_block_start", "content_block_stop"]


# ---- re-runs and errors -------------------------------------------------------------------------


def test_a_rerun_repeats_nothing_already_sent() -> None:
    replay = Replay()
    first = [StreamEvent("start"), StreamEvent("delta", text="Hel"), StreamEvent("tool_call", data=CALL)]
    again = [StreamEvent("start"), StreamEvent("delta", text="He"), StreamEvent("delta", text="llo")]
    again += [StreamEvent("tool_call", data=CALL), StreamEvent("tool_call", data=CALL), StreamEvent("end")]
    passed = [replay.fresh(event) for event in first + again]
    kept = [(e.kind, e.text) for e in passed if e is not None]
    assert kept == [("delta", "Hel"), ("tool_call", ""), ("delta", "lo"), ("tool_call", ""), ("end", "")]
    assert passed[-1] is not None and passed[-1].finish_reason is None
    # The end event passes as the worker wrote it (its finish reason is the result's: worker/loop/results.py).
    ended = Replay()
    ended.fresh(StreamEvent("tool_call", data=CALL))
    assert ended.fresh(StreamEvent("end", finish_reason="tool_calls")) == StreamEvent(
        "end", finish_reason="tool_calls"
    )


def test_errors_take_each_apis_shape_and_job_failures_their_status() -> None:
    error = APIError(404, "no such model", code="model_not_found", param="model")
    assert error.body("openai") == {
        "error": {
            "message": "no such model",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    assert error.body("anthropic") == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "no such model"},
    }
    assert APIError(503, "later", retry_after=5).headers() == {"Retry-After": "5"}
    assert (
        flavor_of("/v1/messages/count_tokens") == "anthropic"
        and flavor_of("/v1/chat/completions") == "openai"
    )
    assert (
        from_job_failure(JobFailedError("j", "too long", code=ErrorCode.CONTEXT_LENGTH_EXCEEDED)).status
        == 400
    )
    assert from_job_failure(JobFailedError("j", "slow", code=ErrorCode.TIMEOUT)).status == 504
    assert from_job_failure(JobFailedError("j", "boom", code=ErrorCode.ENGINE_ERROR)).status == 500
    assert from_job_failure(JobCanceledError("j")).code == "job_canceled"
    assert b"event: error\ndata: " in error.sse("anthropic") and error.sse("openai").startswith(b"data: ")


def test_messages_output_format_is_structured_output_and_hints_are_dropped() -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    body = {
        "max_tokens": 5,
        "messages": [{"role": "user", "content": "x"}],
        "output_config": {"format": {"type": "json_schema", "schema": schema}, "effort": "low"},
        "cache_control": {"type": "ephemeral"},
        "service_tier": "auto",
    }
    fields = anthropic_api.parse(body).fields
    assert fields["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema},
    }
    assert "cache_control" not in fields and "service_tier" not in fields
    GenerationRequest.model_validate(fields)
    with pytest.raises(APIError):
        anthropic_api.parse({**body, "output_config": {"format": {"type": "xml"}}})
