"""The request fields agents send (tools, samplers, logprobs, response_format) and the result fields back."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from producer.models import ChatMessage, GenerationRequest, GenerationResult

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def chat(**fields: Any) -> GenerationRequest:
    return GenerationRequest(messages=USER, **fields)


def test_a_full_agent_request_round_trips_through_its_payload() -> None:
    request = GenerationRequest(
        messages=[
            {
                "role": "system",
                "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
            },
            *USER,
            {
                "role": "assistant",
                "content": None,
                "reasoning": "I should look it up.",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
        ],
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.1,
        repetition_context_size=64,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logit_bias={"42": -100, "7": 2.5},
        logprobs=True,
        top_logprobs=5,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "w", "schema": {"type": "object"}, "strict": True},
        },
        chat_template_kwargs={"enable_thinking": False},
    )
    payload = request.job_payload()
    assert payload["response_format"]["json_schema"]["schema"] == {
        "type": "object"
    }  # OpenAI's name on the wire
    assert GenerationRequest.model_validate(payload) == request
    assert request.logit_bias_ids == {42: -100.0, 7: 2.5}
    assert request.messages is not None
    assert request.messages[0].text == "Be brief."
    assistant = request.messages[2].template_dict()
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # parsed for templates
    assert assistant["reasoning"] == "I should look it up."


def test_a_plain_request_payload_carries_no_new_fields() -> None:
    assert set(chat().job_payload()) == {"messages", "max_tokens", "temperature", "top_p", "stop", "metadata"}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"top_k": -1}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_context_size": 0}, "repetition_context_size"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"logit_bias": {"abc": 1}}, "logit_bias keys are token ids"),
        ({"logit_bias": {"-3": 1}}, "logit_bias keys are token ids"),
        ({"logit_bias": {"3": 101}}, r"biases lie in \[-100, 100\]"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": 3}, "top_logprobs needs logprobs"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "name"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "name"),
        ({"tools": [WEATHER, WEATHER]}, "get_weather offered twice"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
            "invalid JSON schema",
        ),
        ({"tool_choice": "required"}, "needs tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
            "'get_time', which is not among the tools offered",
        ),
        ({"response_format": {"type": "xml"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}},
            "invalid JSON schema at type",
        ),
        ({"chat_template_kwargs": {"x": object()}}, "chat_template_kwargs must be JSON-serializable"),
        ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs may not set tokenize"),
    ],
)
def test_bad_values_get_a_clear_error(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        chat(**fields)


def test_tools_need_messages() -> None:
    with pytest.raises(ValidationError, match="tools and chat_template_kwargs go with 'messages'"):
        GenerationRequest(prompt="hi", tools=[WEATHER])


@pytest.mark.parametrize(
    ("message", "error"),
    [
        ({"role": "user"}, "content may be left out only on an assistant message with tool_calls"),
        ({"role": "tool", "content": "18 C"}, "needs the tool_call_id"),
        ({"role": "user", "content": "x", "tool_call_id": "c"}, "tool_call_id belongs on tool messages"),
        (
            {
                "role": "user",
                "content": "x",
                "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}],
            },
            "only assistant messages carry tool_calls",
        ),
        ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "content"),
    ],
)
def test_messages_are_checked_by_role(message: dict[str, Any], error: str) -> None:
    with pytest.raises(ValidationError, match=error):
        ChatMessage.model_validate(message)


def test_a_result_carries_tool_calls_reasoning_and_logprobs() -> None:
    result = GenerationResult(
        job_id="j",
        agent_id=None,
        text="",
        token_ids=[1, 2],
        finish_reason="tool_calls",
        tool_calls=[{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        reasoning="thinking",
        logprobs=[
            {
                "token": "a",
                "token_id": 1,
                "logprob": -0.5,
                "bytes": [97],
                "top_logprobs": [{"token": "a", "token_id": 1, "logprob": -0.5, "bytes": [97]}],
            }
        ],
        usage={"prompt_tokens": 3, "reused_tokens": 0, "prefilled_tokens": 3, "generated_tokens": 2},
        timings={"queued_s": 0.0, "time_to_first_token_s": 0.1, "total_s": 0.2},
    )
    assert GenerationResult.model_validate_json(result.model_dump_json()) == result
