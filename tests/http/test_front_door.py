"""Inputs that once got a 500 from `kvrq serve`, or passed when they should not: each is now a 400
naming the field, answered before any job is enqueued (fakeredis, no worker: a body that passes every
check gets the no-worker 503, which proves it was accepted)."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from producer.http.app import ServeSettings, create_app
from producer.http.openapi import OPERATIONS
from producer.models import MAX_JSON_DEPTH, GenerationRequest, json_depth_problem
from tests.producer.fakes import app_connections

CHAT: dict[str, Any] = {
    "model": "smollm2-135m",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 4,
}
MESSAGES = {**CHAT}
JOB = {"messages": CHAT["messages"]}
RESPONSES = {"model": "smollm2-135m", "input": "hi", "max_output_tokens": 4}


def nested(levels: int) -> dict[str, Any]:
    """An object `levels` deep: {"a": {"a": ... {}}}."""
    value: dict[str, Any] = {}
    for _ in range(levels - 1):
        value = {"a": value}
    return value


def schema(levels: int) -> dict[str, Any]:
    """A valid JSON Schema nesting object schemas: 2 levels each (the schema and its properties)."""
    value: dict[str, Any] = {"type": "string"}
    for _ in range(levels // 2):
        value = {"type": "object", "properties": {"a": value}}
    return value


@pytest.fixture
def http() -> TestClient:
    return TestClient(create_app(ServeSettings(), **app_connections()))


def refused(answer: Any, *words: str) -> str:
    """The message of a 400 in either API's shape, checked to hold `words`."""
    assert answer.status_code == 400, answer.text
    message = answer.json()["error"]["message"]
    assert all(word in message for word in words), message
    return str(message)


def accepted(answer: Any) -> None:
    """Past every check of the body: only the missing worker stops it."""
    assert answer.status_code == 503, answer.text


def test_depth_rule_counts_levels_and_names_the_path() -> None:
    assert json_depth_problem(nested(MAX_JSON_DEPTH), "v") is None
    problem = json_depth_problem({"tools": [nested(MAX_JSON_DEPTH)]}, "body")
    assert problem is not None and problem.startswith("body.tools[0].a.a")
    assert json_depth_problem(nested(100_000), "v") is not None  # no recursion to run out of


@pytest.mark.parametrize(
    "field",
    [
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": schema(300)}}]},
        {"chat_template_kwargs": nested(300)},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema(300)}}},
        {"tool_choice": nested(300)},
        {"metadata": nested(300)},
    ],
    ids=["tools", "chat_template_kwargs", "response_format", "tool_choice", "metadata"],
)
def test_deep_fields_on_chat_are_400_naming_the_field(http: TestClient, field: dict[str, Any]) -> None:
    (name,) = field
    refused(http.post("/v1/chat/completions", json={**CHAT, **field}), f"body.{name}", "64 levels")


def test_deep_fields_on_messages_and_responses_are_400(http: TestClient) -> None:
    tool = {"name": "f", "input_schema": schema(300)}
    refused(http.post("/v1/messages", json={**MESSAGES, "tools": [tool]}), "body.tools[0].input_schema")
    refused(http.post("/v1/messages", json={**MESSAGES, "metadata": nested(600)}), "body.metadata")
    # Once a 500 after the job had run (RecursionError saving the response): now refused before it.
    refused(http.post("/v1/responses", json={**RESPONSES, "metadata": nested(600)}), "body.metadata")
    refused(http.post("/v1/conversations", json={"metadata": nested(600)}), "body.metadata")


def test_a_producers_deep_field_is_refused_when_validated_not_when_enqueued() -> None:
    with pytest.raises(ValidationError, match="deeper than 64 levels"):
        GenerationRequest.model_validate({**JOB, "chat_template_kwargs": nested(300)})
    within = GenerationRequest.model_validate({**JOB, "chat_template_kwargs": nested(MAX_JSON_DEPTH)})
    assert within.job_payload()["chat_template_kwargs"] == nested(MAX_JSON_DEPTH)


@pytest.mark.parametrize("field", ["max_tokens", "temperature", "top_p", "seed", "top_k"])
def test_a_boolean_is_not_a_number(http: TestClient, field: str) -> None:
    refused(http.post("/v1/chat/completions", json={**CHAT, field: True}), field)


def test_booleans_for_numbers_on_every_api(http: TestClient) -> None:
    refused(http.post("/v1/messages", json={**MESSAGES, "max_tokens": True}), "max_tokens")
    refused(http.post("/v1/messages", json={**MESSAGES, "temperature": True}), "temperature")
    refused(http.post("/v1/responses", json={**RESPONSES, "max_output_tokens": True}), "max_tokens")
    refused(http.post("/v1/completions", json={"prompt": "hi", "max_tokens": False}), "max_tokens")
    refused(http.post("/v1/chat/completions", json={**CHAT, "logprobs": 1}), "logprobs")
    accepted(http.post("/v1/chat/completions", json={**CHAT, "temperature": 1}))  # an integer is a number


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/chat/completions", {**CHAT, "user": 5}, "user"),
        ("/v1/chat/completions", {**CHAT, "store": "yes"}, "store"),
        ("/v1/chat/completions", {**CHAT, "metadata": {"k": 1}}, "metadata.k"),
        ("/v1/chat/completions", {**CHAT, "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
        ("/v1/completions", {"prompt": "hi", "service_tier": 1}, "service_tier"),
        ("/v1/responses", {**RESPONSES, "include": "x"}, "include"),
        ("/v1/responses", {**RESPONSES, "safety_identifier": []}, "safety_identifier"),
        ("/v1/responses", {**RESPONSES, "metadata": {"k": {"deep": "x"}}}, "metadata.k"),
        ("/v1/messages", {**MESSAGES, "metadata": {"user_id": 7}}, "metadata.user_id"),
        ("/v1/messages", {**MESSAGES, "service_tier": "fastest"}, "service_tier"),
    ],
)
def test_dropped_fields_are_still_typed(
    http: TestClient, path: str, body: dict[str, Any], field: str
) -> None:
    refused(http.post(path, json=body), field)


def test_dropped_fields_of_the_right_type_pass(http: TestClient) -> None:
    typed = {"user": "u", "store": False, "metadata": {"k": "v"}, "service_tier": "auto"}
    accepted(http.post("/v1/chat/completions", json={**CHAT, **typed}))
    accepted(http.post("/v1/messages", json={**MESSAGES, "metadata": {"user_id": "bob"}}))


def test_responses_refuses_an_empty_input_string(http: TestClient) -> None:
    refused(http.post("/v1/responses", json={**RESPONSES, "input": ""}), "non-empty")
    refused(http.post("/v1/responses", json={**RESPONSES, "input": []}), "non-empty")


def test_max_tokens_null_is_the_default_not_an_error(http: TestClient) -> None:
    accepted(http.post("/v1/chat/completions", json={**CHAT, "max_tokens": None}))
    assert GenerationRequest(prompt="x").max_tokens == 256  # docs/http.md: kvrq's cap, said so


def test_405_names_the_allowed_methods_and_is_a_client_error(http: TestClient) -> None:
    answer = http.get("/v1/chat/completions")
    assert answer.status_code == 405 and answer.headers["allow"] == "POST"
    assert answer.json()["error"]["type"] == "invalid_request_error"
    answer = http.put("/v1/messages", json={})
    assert answer.status_code == 405 and answer.headers["allow"] == "POST"
    assert answer.json() == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": answer.json()["error"]["message"]},
    }
    answer = http.patch("/v1/conversations/conv_x")
    assert answer.status_code == 405
    assert answer.headers["allow"] == "DELETE, GET, POST"


def test_openapi_json_documents_every_route_with_its_body_answers_and_errors(http: TestClient) -> None:
    document = http.get("/openapi.json").json()
    published = {(method, path) for path, item in document["paths"].items() for method in item}
    assert published == set(OPERATIONS)  # a new route gets its entry in producer/http/openapi.py
    for (method, path), (body, _) in OPERATIONS.items():
        operation = document["paths"][path][method]
        assert ("requestBody" in operation) == (body is not None), (method, path)
        assert {"200", "4XX", "5XX"} <= set(operation["responses"]), (method, path)
    error = document["paths"]["/v1/messages"]["post"]["responses"]["4XX"]["content"]["application/json"]
    assert error["schema"]["$ref"].endswith("/AnthropicError")


@pytest.mark.parametrize(
    "path",
    ["/v1/responses/..%2F..%2Fetc%2Fpasswd", "/v1/conversations/..%2Fx", "/v1/conversations/..%2Fx/items"],
)
def test_a_path_id_that_climbs_is_not_found(http: TestClient, path: str) -> None:
    answer = http.get(path)
    assert answer.status_code == 404 and answer.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "field", [{"prompt_cache_key": "../etc/passwd"}, {"kvrq": {"fork_from": "../x"}}], ids=["agent", "fork"]
)
def test_a_body_id_that_climbs_is_400(http: TestClient, field: dict[str, Any]) -> None:
    refused(http.post("/v1/chat/completions", json={**CHAT, **field}), "agent id '../")


def test_a_temperature_too_small_for_float32_samples_greedy() -> None:
    # Found by tests/http/test_openapi_fuzz.py: 6e-288 made 1/temperature inf in the sampler, and a
    # response_format grammar's mask NaN, so the worker sampled a refused token and failed the job.
    assert GenerationRequest.model_validate({**JOB, "temperature": 6e-288}).temperature == 0.0
    assert GenerationRequest.model_validate({**JOB, "temperature": 1e-6}).temperature == 1e-6
