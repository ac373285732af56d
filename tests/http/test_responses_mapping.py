"""The Responses API's shapes without a server: bodies to GenerationRequest fields, input items to chat
messages, the stream translator, and records scoped to the API key that made them (fakeredis)."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from openai.types.responses import Response

from producer.http import responses_api as api
from producer.http.app import ServeSettings, create_app
from producer.http.conversations import Records, StoredResponse, scope_of
from producer.http.errors import APIError
from producer.models import GenerationRequest, GenerationResult
from producer.tenants import key_tenant
from producer.wire.protocol import StreamEvent
from tests.http.test_mapping import RESULT, events
from tests.producer.fakes import app_connections, fake_redis

WEATHER = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}


def test_a_body_maps_onto_request_fields() -> None:
    parsed = api.parse(
        {
            "model": "m",
            "input": "Hi",
            "instructions": "Be brief.",
            "tools": [WEATHER],
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "max_output_tokens": 9,
            "temperature": 0.5,
            "top_p": 0.9,
            "reasoning": {"effort": "none"},
            "text": {"format": {"type": "json_object"}},
            "seed": 3,
            "top_k": 4,
            "include": ["reasoning.encrypted_content"],
            "user": "u",
        }
    )
    assert parsed.fields == {
        "temperature": 0.5,
        "top_p": 0.9,
        "max_tokens": 9,
        "seed": 3,
        "top_k": 4,
        "tools": [
            {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER["parameters"]}}
        ],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "response_format": {"type": "json_object"},
        "chat_template_kwargs": {"enable_thinking": False},
    }
    assert parsed.messages == [{"role": "user", "content": "Hi"}] and parsed.instructions == "Be brief."
    GenerationRequest.model_validate({**parsed.fields, "messages": parsed.messages})  # a valid job
    defaults = api.parse({"input": "x"})
    assert defaults.fields == {"temperature": 1.0, "top_p": 1.0} and defaults.store


def test_items_become_chat_messages_with_calls_merged_and_reasoning_attached() -> None:
    items = api.input_items(
        [
            {"role": "developer", "content": "Rules."},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Wea"}, {"type": "input_text", "text": "ther?"}],
            },
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "hmm"}],
            },
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Let me look."}],
            },
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {
                "type": "function_call_output",
                "call_id": "c9",
                "output": [{"type": "input_text", "text": "?"}],
            },
        ]
    )
    messages, calls, answered = api.chat_messages(items)
    assert messages == [
        {"role": "system", "content": "Rules."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "reasoning": "hmm",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}},
                {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c9", "content": "?"},
    ]
    assert calls == {"c1", "c2"} and answered == ("c9",)  # c9's call must be in the previous response
    assert all(item["id"] for item in items) and items[2]["id"] == "rs_1"
    GenerationRequest.model_validate({"messages": messages})


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"input": []}, "non-empty"),
        ({"input": "x", "previous_response_id": "r", "conversation": "c"}, "not both"),
        ({"input": "x", "conversation": "c", "store": False}, "store"),
        ({"input": "x", "tools": [{**WEATHER, "frobnicate": True}]}, "frobnicate"),
        ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "x"}}, "not among"),
        (
            {
                "input": "x",
                "tool_choice": {
                    "type": "allowed_tools",
                    "mode": "required",
                    "tools": [{"type": "function", "name": "f"}],
                },
            },
            "not among",
        ),
        ({"input": "x", "tool_choice": {"type": "mcp", "server_label": "s"}}, "mcp"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "frobnicate": 1}, "frobnicate"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "item_reference"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "", "arguments": "{}"}]}, "name"),
        ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text.format"),
    ],
)
def test_bad_bodies_are_400_with_the_reason(body: dict[str, Any], says: str) -> None:
    with pytest.raises(APIError) as caught:
        api.parse(body)
    assert caught.value.status == 400 and says in caught.value.message


def result(**fields: Any) -> GenerationResult:
    return GenerationResult.model_validate({**RESULT, "job_id": "j1", **fields})


def test_a_result_is_a_response_openai_parses() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    done = result(text="Sure.", reasoning="think", tool_calls=[call], finish_reason="tool_calls")
    echo = api.parse({"input": "x", "tools": [WEATHER]}).echo
    body = api.response_object(
        "resp_1", "m", echo, created_at=1, output=api.output_items(done), status="completed", result=done
    )
    response = Response.model_validate(body)
    assert [item.type for item in response.output] == ["reasoning", "message", "function_call"]
    assert response.output_text == "Sure."
    assert response.usage is not None
    assert response.usage.input_tokens_details.cached_tokens == done.usage.reused_tokens
    assert response.usage.input_tokens == done.usage.prompt_tokens


def test_a_stream_holds_back_whitespace_before_a_call() -> None:
    stream = api.ResponseStream("resp_1", "m", api.parse({"input": "x"}).echo)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    chunks = stream.head()
    for event in [
        StreamEvent("delta", text="\n"),
        StreamEvent("tool_call", data=call),
        StreamEvent("end", finish_reason="tool_calls"),
    ]:
        chunks += stream.event(event)
    chunks += stream.tail(result(text="", tool_calls=[call], finish_reason="tool_calls"))
    kinds = [name for name, _ in events(chunks)]
    assert "response.output_text.delta" not in kinds  # no message of a lone newline
    final = events(chunks)[-1][1]
    assert [item["type"] for item in final["response"]["output"]] == ["function_call"]
    assert [data["sequence_number"] for _, data in events(chunks)] == list(range(len(kinds)))


def test_records_are_scoped_to_the_api_key_that_made_them() -> None:
    redis = fake_redis()
    records = Records(redis)
    owner = key_tenant("key-a")  # the tenant of a key no operator named: a digest, never the key
    assert owner != key_tenant("key-b") and "key-a" not in owner
    assert scope_of({"type": "http", "headers": []}) == ""  # no keys: one scope
    body = {"id": "resp_a", "object": "response", "output": []}
    records.save_response("resp_a", StoredResponse(owner, "responses:resp_a", body, []))
    app = create_app(ServeSettings(api_keys=("key-a", "key-b")), **app_connections(redis))
    with TestClient(app) as http:
        mine = http.get("/v1/responses/resp_a", headers={"authorization": "Bearer key-a"})
        assert mine.status_code == 200 and mine.json() == body
        theirs = http.get("/v1/responses/resp_a", headers={"authorization": "Bearer key-b"})
        assert (
            theirs.status_code == 404
            and theirs.json()["error"]["message"] == "Response with id 'resp_a' not found"
        )
        assert http.delete("/v1/responses/resp_a", headers={"x-api-key": "key-b"}).status_code == 404
        follow = http.post(
            "/v1/responses",
            json={"input": "x", "previous_response_id": "resp_a"},
            headers={"x-api-key": "key-b"},
        )
        assert follow.status_code == 400 and follow.json()["error"]["param"] == "previous_response_id"
        made = http.post("/v1/conversations", json={}, headers={"x-api-key": "key-a"}).json()
        assert http.get(f"/v1/conversations/{made['id']}", headers={"x-api-key": "key-b"}).status_code == 404
        assert http.get(f"/v1/conversations/{made['id']}", headers={"x-api-key": "key-a"}).status_code == 200
    assert records.response("resp_a", owner) is not None  # the other key's delete removed nothing
