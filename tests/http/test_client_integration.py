"""Requests shaped as Claude Code and Codex CLI send them (tests/http/test_client_shapes.py has the
bodies), through a real `kvrq serve`, redis-server and `kvrq worker` on the builtin model: streamed as
each API streams, the agent's next turn resumed, max_tokens beyond the context cut to it, a named
forced tool called once."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from redis import Redis

from producer.http.ignored import HEADER
from producer.http.model_cards import CLAMP_HEADER
from tests.http.test_client_shapes import claude_code_body, codex_body
from tests.http.test_integration import MODEL, QUESTION, ServeProcess, serve_stack

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CLAUDE_HEADERS = {
    "anthropic-version": "2023-06-01",
    "anthropic-beta": "claude-code-20250219,context-management-2025-06-27,interleaved-thinking-2025-05-14,"
    "mid-conversation-system-2026-04-07,effort-2025-11-24",
    "x-api-key": "unused",
}
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup_capital",
        "description": "The capital of a country.",
        "parameters": {
            "type": "object",
            "properties": {"country": {"type": "string"}},
            "required": ["country"],
        },
    },
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    with serve_stack(tmp_path_factory.mktemp("clients"), "clients-worker") as (serve, _):
        yield serve


def events(response: httpx.Response) -> list[dict[str, Any]]:
    """The `data:` payloads of a server-sent event stream."""
    return [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]


def claude_turn(url: str, body: dict[str, Any]) -> tuple[httpx.Response, list[dict[str, Any]]]:
    response = httpx.post(f"{url}/v1/messages?beta=true", json=body, headers=CLAUDE_HEADERS, timeout=120)
    assert response.status_code == 200, response.text
    return response, events(response)


def body_settings(body: dict[str, Any]) -> dict[str, Any]:
    return {"max_tokens": body["max_tokens"], "temperature": body["temperature"]}


def test_claude_code_streams_and_its_next_turn_resumes_despite_a_new_cch(server: ServeProcess) -> None:
    assert httpx.head(server.url, timeout=5).status_code == 200  # Claude Code's probe
    body = {**claude_code_body(cch="11111"), "max_tokens": 48, "temperature": 0}
    response, first = claude_turn(server.url, body)
    kinds = [event["type"] for event in first]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert "content_block_delta" in kinds
    assert response.headers[HEADER] == "system[0],tools.web_search,output_config.effort"
    usage = first[-2]["usage"]
    shared = usage["input_tokens"] + usage["cache_read_input_tokens"]  # turn 1's whole prompt
    text = "".join(e["delta"].get("text", "") for e in first if e["type"] == "content_block_delta")
    turns = [
        *body["messages"],
        {"role": "assistant", "content": [{"type": "text", "text": text}]},
        {"role": "user", "content": "Thanks. Now the hidden ones."},
    ]
    _, second = claude_turn(server.url, {**claude_code_body(cch="22222", turns=turns), **body_settings(body)})
    reused = second[-2]["usage"]["cache_read_input_tokens"]
    assert reused >= 0.95 * shared, (reused, shared)


def test_codex_responses_request_with_a_namespace_and_web_search(server: ServeProcess) -> None:
    body = {**codex_body(), "max_output_tokens": 64, "temperature": 0}
    body["tools"] = [tool for tool in body["tools"] if tool.get("name") != "shell"]  # the namespace's alone
    spawn = body["tools"][0]["tools"][0]  # a short task, so the 135M model's call fits max_output_tokens
    spawn["parameters"]["properties"]["task"]["maxLength"] = 20
    body["tool_choice"] = "required"
    body["parallel_tool_calls"] = False  # Codex sends true; one call keeps the 135M model's answer short
    response = httpx.post(f"{server.url}/v1/responses", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert response.headers[HEADER] == "include,client_metadata,tools.web_search,reasoning.summary"
    streamed = events(response)
    assert streamed[0]["type"] == "response.created"
    assert streamed[-1]["type"] == "response.completed", json.dumps(streamed[-1])
    assert any(event["type"] == "response.function_call_arguments.delta" for event in streamed)
    calls = [item for item in streamed[-1]["response"]["output"] if item["type"] == "function_call"]
    assert calls and all((c["name"], c["namespace"]) == ("spawn_agent", "multi_agent_v1") for c in calls)
    # Codex's next turn: store false, the whole history again, the same prompt_cache_key
    history = [
        *body["input"],
        *({k: v for k, v in call.items() if k != "status"} for call in calls),
        *({"type": "function_call_output", "call_id": c["call_id"], "output": "started"} for c in calls),
    ]
    again = httpx.post(
        f"{server.url}/v1/responses",
        json={**body, "input": history, "tool_choice": "auto", "stream": False},
        timeout=120,
    )
    assert again.status_code == 200, again.text
    first_prompt = streamed[-1]["response"]["usage"]["input_tokens"]
    assert again.json()["usage"]["input_tokens_details"]["cached_tokens"] >= 0.95 * first_prompt


def test_max_tokens_beyond_the_context_is_cut_to_what_it_leaves(server: ServeProcess) -> None:
    context = httpx.get(f"{server.url}/v1/models", timeout=5).json()["data"][0]["context_length"]
    assert context > 0
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 32000, "temperature": 0}
    answer = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    prompt = answer.json()["usage"]["prompt_tokens"]
    assert answer.headers[CLAMP_HEADER] == str(context - prompt)
    with httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True}, timeout=120
    ) as streamed:  # the same clamp, in the stream's headers (its first event not awaited here)
        assert streamed.status_code == 200 and streamed.headers[CLAMP_HEADER] == str(context - prompt)
    too_long = {**body, "messages": [{"role": "user", "content": "hi " * (context + 100)}], "max_tokens": 5}
    refused = httpx.post(f"{server.url}/v1/chat/completions", json=too_long, timeout=120)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    assert str(context) in refused.json()["error"]["message"]


def test_a_named_forced_tool_ends_after_one_call(server: ServeProcess) -> None:
    body = {
        "model": MODEL,
        "messages": QUESTION,
        "tools": [LOOKUP],
        "tool_choice": {"type": "function", "function": {"name": "lookup_capital"}},
        "max_tokens": 200,
        "temperature": 0,
    }
    answer = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).json()
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and len(choice["message"]["tool_calls"]) == 1
    assert answer["usage"]["completion_tokens"] < 200


def test_the_worker_publishes_its_context(server: ServeProcess) -> None:
    redis = Redis.from_url(server.redis_url)
    keys = [key for key in redis.keys("rq:worker:*") if redis.type(key) == b"hash"]
    assert any(redis.hget(key, "kvrq_context") for key in keys)
