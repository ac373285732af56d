"""kvrq's tool format for templates that declare none: tools, calls and results written into the messages,
and a call written back is what the forced-call grammar lets a model write (so the KV resumes past it)."""

from __future__ import annotations

import json
from typing import Any

from producer.models import GenerationRequest
from tests.worker.test_tool_grammar import WEATHER, compiler, splitter, tokenizer  # noqa: F401 (fixtures)
from worker.requests.output_split import splitter_for
from worker.requests.prompts import prompt_tokens
from worker.requests.tool_format import MARKERS, written_into_messages
from worker.requests.tool_grammar import forced_tool_calls

CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
}
HISTORY = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"},
]


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    request = GenerationRequest.model_validate({"messages": messages})
    assert request.messages is not None
    return [m.template_dict() for m in request.messages]


def test_tools_go_into_a_new_system_message_and_calls_and_results_become_text() -> None:
    out = written_into_messages(template_messages(HISTORY), [WEATHER])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert json.dumps(WEATHER) in out[0]["content"] and "<tool_call>" in out[0]["content"]
    assert out[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
    }
    assert out[3] == {"role": "user", "content": "<tool_response>\n-3 C\n</tool_response>"}
    assert all("tool_calls" not in m for m in out)


def test_an_existing_system_message_keeps_its_text_first() -> None:
    out = written_into_messages(
        template_messages([{"role": "system", "content": "Be brief."}, *HISTORY]), [WEATHER]
    )
    assert out[0]["content"].startswith("Be brief.\n\n") and json.dumps(WEATHER) in out[0]["content"]
    assert len(out) == 4


def test_without_tools_the_history_is_still_written_as_text() -> None:
    out = written_into_messages(template_messages(HISTORY), None)
    assert [m["role"] for m in out] == ["user", "assistant", "user"]


def test_the_builtin_template_renders_the_tools_and_splits_calls(tokenizer: Any) -> None:  # noqa: F811
    request = GenerationRequest.model_validate({"messages": HISTORY, "tools": [WEATHER]})
    text = tokenizer.decode(prompt_tokens(tokenizer, request))
    assert "<tools>" in text and '"arguments": {"city": "Oslo"}' in text and "<tool_response>" in text
    output = splitter_for(tokenizer, request, [])
    assert output is not None and output.tool_markers == MARKERS


def test_a_call_written_back_is_what_the_forced_grammar_admits(tokenizer: Any, compiler: Any) -> None:  # noqa: F811
    request = GenerationRequest.model_validate(
        {"messages": HISTORY[:1], "tools": [WEATHER], "tool_choice": "required"}
    )
    grammar = forced_tool_calls(tokenizer, request, splitter())
    assert grammar is not None
    written = written_into_messages(template_messages(HISTORY), None)[1]["content"]
    matcher = compiler.processor(grammar).matcher
    assert matcher.consume_tokens(list(tokenizer.encode(written, add_special_tokens=False)))
    assert matcher.is_accepting()
