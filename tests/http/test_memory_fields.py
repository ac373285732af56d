"""The `kvrq` object of chat and messages bodies, and the agent ids those routes may name."""

from __future__ import annotations

from typing import Any

import pytest

from producer.http import anthropic_api, openai_api
from producer.http.errors import APIError
from producer.openai_shapes.bodies import CHAT_URL

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
MESSAGES = {**CHAT, "max_tokens": 8}


def test_continue_and_fork_from_reach_the_request() -> None:
    parsed = openai_api.parse(CHAT_URL, {**CHAT, "prompt_cache_key": "a", "kvrq": {"continue": True}})
    assert parsed.fields["continue"] is True and parsed.fields["agent_id"] == "a"
    parsed = anthropic_api.parse({**MESSAGES, "metadata": {"user_id": "b"}, "kvrq": {"fork_from": "a"}})
    assert parsed.fields["fork_from"] == "a" and parsed.fields["agent_id"] == "b"


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ({**CHAT, "kvrq": {"continue": "yes"}}, "kvrq.continue"),
        ({**CHAT, "kvrq": {"remember": True}}, "continue, fork_from, namespace"),
        ({**CHAT, "kvrq": ["continue"]}, "continue, fork_from, namespace"),
        ({**CHAT, "kvrq": {"fork_from": "responses:resp_1"}}, "previous_response_id"),
        ({**CHAT, "prompt_cache_key": "responses:resp_1"}, "Responses API"),
        ({**CHAT, "prompt_cache_key": "conversations:conv_1"}, "Responses API"),
    ],
)
def test_bad_kvrq_fields_and_reserved_agents_are_400(body: dict[str, Any], problem: str) -> None:
    with pytest.raises(APIError) as error:
        openai_api.parse(CHAT_URL, body)
    assert error.value.status == 400 and problem in str(error.value.message)


def test_anthropic_routes_refuse_a_responses_agent_too() -> None:
    with pytest.raises(APIError) as error:
        anthropic_api.parse({**MESSAGES, "metadata": {"user_id": "responses:resp_1"}})
    assert error.value.status == 400
    with pytest.raises(APIError):
        anthropic_api.parse(MESSAGES, agent="conversations:conv_1")


ALLOWED = {
    **CHAT,
    "tools": [
        {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
        for name in ("look", "book", "cancel")
    ],
}


def test_allowed_tools_offers_only_the_listed_tools_with_its_mode() -> None:
    choice = {
        "type": "allowed_tools",
        "allowed_tools": {"mode": "required", "tools": [{"type": "function", "function": {"name": "book"}}]},
    }
    parsed = openai_api.parse(CHAT_URL, {**ALLOWED, "tool_choice": choice})
    assert [tool["function"]["name"] for tool in parsed.fields["tools"]] == ["book"]
    assert parsed.fields["tool_choice"] == "required"


@pytest.mark.parametrize(
    "allowed",
    [
        {"mode": "always", "tools": [{"type": "function", "function": {"name": "book"}}]},
        {"mode": "auto", "tools": []},
        {"mode": "auto", "tools": [{"type": "function", "function": {"name": "fly"}}]},
    ],
)
def test_bad_allowed_tools_are_400(allowed: dict[str, Any]) -> None:
    with pytest.raises(APIError) as error:
        openai_api.parse(
            CHAT_URL, {**ALLOWED, "tool_choice": {"type": "allowed_tools", "allowed_tools": allowed}}
        )
    assert error.value.status == 400 and "allowed_tools" in error.value.message
