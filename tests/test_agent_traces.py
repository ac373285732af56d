"""The coding-agent traces of benchmarks/bench_agent_loops.py send what today's clients send."""

from __future__ import annotations

import json

from benchmarks.agent_traces import (
    CACHE_CONTROL,
    Call,
    Trace,
    anthropic_request,
    chat_messages,
    responses_input,
    system_prompt,
)


def test_sessions_share_the_system_prompt_and_differ_from_the_first_user_message_on() -> None:
    a, b = chat_messages(Trace(0, "s-0")), chat_messages(Trace(1, "s-1"))
    assert a[0] == b[0] == {"role": "system", "content": system_prompt()}
    assert len(system_prompt()) > 3500  # ~900 tokens of instructions before the tools
    assert a[1]["content"].startswith("<environment>\nSession: s-0\n") and a[1] != b[1]


def test_every_step_is_a_tool_round_trip_on_the_models_own_answer() -> None:
    trace = Trace(2, "s")
    own = Call("c1", "grep", json.dumps({"pattern": "next_delay"}))
    trace.add_step(1, "Looking.", [own])
    trace.add_step(2, "I will read the file now.", [])  # no call: the plan's call follows the text
    messages = chat_messages(trace)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant", "tool"]
    assert messages[2]["content"] == "Looking." and messages[2]["tool_calls"][0]["id"] == "c1"
    assert messages[4]["content"] == "I will read the file now."
    assert messages[4]["tool_calls"][0]["function"]["name"] == "grep"  # PLAN[1]
    assert messages[5]["tool_call_id"] == messages[4]["tool_calls"][0]["id"]
    assert trace.steps[0].scripted is False and trace.steps[1].scripted is True


def test_anthropic_markers_sit_on_the_system_prompt_and_the_last_message_only() -> None:
    trace = Trace(0, "s")
    for turn in (1, 2, 3):
        trace.add_step(turn, "", [])
    body = anthropic_request(trace)
    assert body["system"][0]["cache_control"] == CACHE_CONTROL
    marked = [
        (i, j)
        for i, m in enumerate(body["messages"])
        for j, b in enumerate(m["content"])
        if "cache_control" in b
    ]
    last = len(body["messages"]) - 1
    assert marked == [(last, len(body["messages"][last]["content"]) - 1)]
    assert body["messages"][last]["content"][-1]["type"] == "tool_result"
    first = anthropic_request(Trace(0, "s"))["messages"]
    assert first[0]["content"][0]["cache_control"] == CACHE_CONTROL  # turn 1: the task is the last message


def test_a_responses_follow_up_sends_only_the_new_input() -> None:
    trace = Trace(1, "s")
    assert responses_input(trace) == [{"role": "user", "content": trace.task}]
    trace.add_step(1, "", [Call("fc_1", "list_dir", '{"path": "tilemap"}')])
    assert [item["type"] for item in responses_input(trace)] == ["function_call_output"]
    trace.add_step(2, "Some text, no call.", [])
    items = responses_input(trace)
    assert [item["type"] for item in items] == ["function_call", "function_call_output"]
    assert items[0]["call_id"] == items[1]["call_id"]
