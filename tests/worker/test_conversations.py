"""Agents that remember (continue), forks, and the conversation record, on the fake engine and fakeredis."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from engine.core.blocks import common_prefix_length
from producer.client import JobFailedError
from producer.conversation import ConversationRecord, after_turn, extended
from producer.models import ChatMessage, GenerationRequest
from producer.wire.protocol import ErrorCode
from tests.worker.harness import Harness
from worker.requests.prompts import prompt_tokens


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def run(h: Harness, request: dict[str, Any]) -> Any:
    handle = h.producer.submit({"max_tokens": 3, **request})
    h.run_until(h.all_ended([handle]))
    return handle


def test_a_continued_turn_sends_one_message_and_resumes_the_whole_first_turn() -> None:
    h = Harness()
    first = run(h, {"agent_id": "zed", "messages": [user("capital of France?")], "continue": True}).result()
    second = run(h, {"agent_id": "zed", "messages": [user("and of Spain?")], "continue": True}).result()
    history = [
        user("capital of France?"),
        {"role": "assistant", "content": first.text},
        user("and of Spain?"),
    ]
    expected = prompt_tokens(h.engine.tokenizer, GenerationRequest(messages=history))
    assert h.engine.submitted[-1][1] == expected  # the prompt a client re-sending everything renders
    assert second.usage.reused_tokens >= first.usage.prompt_tokens + first.usage.generated_tokens
    assert h.producer.conversation("zed") == [*history, {"role": "assistant", "content": second.text}]


def test_a_continued_answer_equals_the_answer_to_the_full_history() -> None:
    remembering, resending = Harness(), Harness()
    first = run(remembering, {"agent_id": "a", "messages": [user("hi")], "continue": True}).result()
    run(resending, {"agent_id": "a", "messages": [user("hi")]})
    again = run(remembering, {"agent_id": "a", "messages": [user("more")], "continue": True}).result()
    history = [user("hi"), {"role": "assistant", "content": first.text}, user("more")]
    full = run(resending, {"agent_id": "a", "messages": history}).result()
    assert again.token_ids == full.token_ids
    assert remembering.engine.submitted[-1][1] == resending.engine.submitted[-1][1]


def test_the_first_continue_starts_a_conversation() -> None:
    h = Harness()
    result = run(h, {"agent_id": "new", "messages": [user("hello")], "continue": True}).result()
    assert h.engine.submitted[-1][1] == prompt_tokens(
        h.engine.tokenizer, GenerationRequest(messages=[user("hello")])
    )
    assert h.producer.conversation("new") == [user("hello"), {"role": "assistant", "content": result.text}]


def test_a_job_that_resends_its_history_leaves_a_conversation_to_continue() -> None:
    h = Harness()
    run(h, {"agent_id": "a", "messages": [user("one"), {"role": "assistant", "content": "x"}, user("two")]})
    conversation = h.producer.conversation("a")
    assert conversation is not None and [m["content"] for m in conversation][:3] == ["one", "x", "two"]
    assert h.producer.conversation("nobody") is None


def test_tools_and_template_options_stay_in_force_until_a_turn_sends_new_ones() -> None:
    h = Harness()
    tool = {"type": "function", "function": {"name": "look", "parameters": {"type": "object"}}}
    run(
        h,
        {"agent_id": "t", "messages": [user("a")], "tools": [tool], "tool_choice": "none", "continue": True},
    )
    run(h, {"agent_id": "t", "messages": [user("b")], "continue": True})
    record = ConversationRecord.model_validate_json(h.redis.get("kvrq:agent-conversation:t"))
    assert record.tools is not None and record.tools[0].function.name == "look"


def test_a_failed_turn_appends_nothing() -> None:
    h = Harness()
    run(h, {"agent_id": "a", "messages": [user("keep")], "continue": True})
    before = h.producer.conversation("a")
    handle = run(h, {"agent_id": "a", "messages": [user("BOOM")], "continue": True})
    assert handle.status() == "failed"
    assert h.producer.conversation("a") == before


def test_a_turn_past_the_context_fails_with_a_code_naming_the_options() -> None:
    h = Harness()
    run(h, {"agent_id": "long", "messages": [user("x" * 60)], "continue": True})
    h.engine.max_context = 100
    handle = run(h, {"agent_id": "long", "messages": [user("y" * 30)], "continue": True, "max_tokens": 3})
    with pytest.raises(JobFailedError) as failure:
        handle.result()
    assert failure.value.code == ErrorCode.CONTEXT_LENGTH_EXCEEDED
    message = str(failure.value)
    assert "kvrq agent reset long" in message and "continue: false" in message and "fork_from" in message
    assert len(h.producer.conversation("long") or ()) == 2  # the first turn, untouched


def test_an_evicted_cache_forgets_no_message() -> None:
    h = Harness(recent_prefix_mb=0)  # no copy of the evicted cache kept in the worker's memory either
    first = run(h, {"agent_id": "a", "messages": [user("remember me")], "continue": True}).result()
    h.store.caches.clear()  # evicted (or damaged): the queue's Redis still has the conversation
    run(h, {"agent_id": "a", "messages": [user("who?")], "continue": True})
    history = [user("remember me"), {"role": "assistant", "content": first.text}, user("who?")]
    assert h.engine.submitted[-1][1] == prompt_tokens(h.engine.tokenizer, GenerationRequest(messages=history))
    assert h.engine.submitted[-1][2] == 0  # prefilled, not remembered wrong


def test_the_newer_record_wins_when_cache_and_redis_disagree() -> None:
    h = Harness()
    run(h, {"agent_id": "a", "messages": [user("one")], "continue": True})
    stale_cache = h.store.caches["a"]
    run(h, {"agent_id": "a", "messages": [user("two")], "continue": True})
    h.store.caches["a"] = stale_cache  # the cache put of turn 2 was lost; its record in Redis was not
    run(h, {"agent_id": "a", "messages": [user("three")], "continue": True})
    contents = [m["content"] for m in h.producer.conversation("a") or () if m["role"] == "user"]
    assert contents == ["one", "two", "three"]


def test_a_rerun_of_a_turn_that_was_recorded_does_not_append_it_twice() -> None:
    request = GenerationRequest(agent_id="a", messages=[user("again")], continue_=True)
    stored = ConversationRecord(fence=1, messages=[ChatMessage(role="user", content="before")])
    whole = extended(request, stored, "job-1")
    answered = after_turn(whole, ChatMessage(role="assistant", content="ok"), 2, "job-1", 1)
    rerun = extended(request, answered, "job-1")
    assert [m.text for m in rerun.messages or ()] == ["before", "again"]
    assert [m.text for m in extended(request, answered, "job-2").messages or ()] == [
        "before",
        "again",
        "ok",
        "again",
    ]


def test_a_fork_starts_from_its_parent_and_never_changes_it() -> None:
    h = Harness()
    parent = run(h, {"agent_id": "p", "messages": [user("root")], "continue": True}).result()
    parent_record = h.redis.get("kvrq:agent-conversation:p")
    fork = run(h, {"agent_id": "f", "fork_from": "p", "messages": [user("branch")]}).result()
    assert fork.usage.reused_tokens >= parent.usage.prompt_tokens + parent.usage.generated_tokens
    assert h.redis.get("kvrq:agent-conversation:p") == parent_record
    branch = h.producer.conversation("f") or []
    assert [m["content"] for m in branch[:3]] == ["root", parent.text, "branch"]
    run(h, {"agent_id": "p", "messages": [user("trunk")], "continue": True})
    trunk = [m["content"] for m in h.producer.conversation("p") or () if m["role"] == "user"]
    assert trunk == ["root", "trunk"]


def test_a_fork_onto_an_agent_with_a_conversation_is_refused_and_changes_nothing() -> None:
    h = Harness()
    run(h, {"agent_id": "p", "messages": [user("parent")], "continue": True})
    run(h, {"agent_id": "busy", "messages": [user("mine")], "continue": True})
    before = h.producer.conversation("busy")
    handle = run(h, {"agent_id": "busy", "fork_from": "p", "messages": [user("x")]})
    with pytest.raises(JobFailedError) as failure:
        handle.result()
    assert failure.value.code == ErrorCode.INVALID_REQUEST and "already has a conversation" in str(
        failure.value
    )
    assert h.producer.conversation("busy") == before


def test_a_fork_from_a_missing_agent_is_a_clear_error() -> None:
    h = Harness()
    handle = run(h, {"agent_id": "f", "fork_from": "ghost", "messages": [user("x")]})
    with pytest.raises(JobFailedError) as failure:
        handle.result()
    assert failure.value.code == ErrorCode.INVALID_REQUEST and "'ghost'" in str(failure.value)
    assert h.producer.conversation("f") is None


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"messages": [user("x")], "continue": True}, "continue needs an agent_id"),
        ({"agent_id": "a", "prompt": "x", "continue": True}, "send 'messages', not 'prompt'"),
        ({"agent_id": "a", "messages": [user("x")], "fork_from": "a"}, "cannot fork from itself"),
        ({"agent_id": "a", "messages": [user("x")], "fork_from": "../etc"}, "agent id"),
        ({"agent_id": "a", "messages": [user("x")], "namespace": "a/b"}, "namespace"),
    ],
)
def test_memory_fields_are_checked_before_anything_is_enqueued(fields: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValidationError, match=problem.replace("(", r"\(").replace("'", "'")):
        GenerationRequest.model_validate(fields)


def test_continue_travels_as_continue_on_the_wire() -> None:
    payload = GenerationRequest(agent_id="a", messages=[user("x")], continue_=True).job_payload()
    assert payload["continue"] is True and "continue_" not in payload
    assert "continue" not in GenerationRequest(agent_id="a", messages=[user("x")]).job_payload()


def test_a_job_without_an_agent_resumes_the_prefix_an_earlier_one_left() -> None:
    h = Harness(recent_prefix_mb=0)  # the store's full blocks alone (another worker's view)
    history = [user("a long shared system prompt " * 4), {"role": "assistant", "content": "ok"}]
    first = run(h, {"messages": history}).result()
    second = run(h, {"messages": [*history, user("next")]}).result()
    assert first.usage.reused_tokens == 0
    shared = common_prefix_length(h.engine.submitted[0][1], h.engine.submitted[1][1])
    assert second.usage.reused_tokens == shared // 4 * 4  # its full blocks (the fake's are 4 tokens)


def test_a_tenant_never_reuses_another_tenants_prefix() -> None:
    h = Harness(recent_prefix_mb=0)
    history = [user("the same words in two tenants " * 3)]
    run(h, {"messages": history, "namespace": "acme"})
    other = run(h, {"messages": history, "namespace": "globex"}).result()
    same = run(h, {"messages": history, "namespace": "acme"}).result()
    assert other.usage.reused_tokens == 0 and same.usage.reused_tokens > 0
    assert set(h.store.prefixes) == {"default/acme", "default/globex"}  # narrowed, under the worker's


def test_an_agents_puts_carry_the_jobs_namespace() -> None:
    h = Harness()
    run(h, {"agent_id": "a", "messages": [user("x")], "namespace": "team1"})
    run(h, {"agent_id": "b", "messages": [user("x")]})
    assert h.store.namespaces == [("a", "default/team1"), ("b", None)]


def test_prefix_reuse_off_keeps_nothing() -> None:
    h = Harness(prefix_cache_mb=0, recent_prefix_mb=0)
    run(h, {"messages": [user("words " * 10)]})
    again = run(h, {"messages": [user("words " * 10)]}).result()
    assert again.usage.reused_tokens == 0 and h.store.prefixes == {}


def test_a_forgotten_conversation_never_comes_back_from_the_cache() -> None:
    from producer.conversation import forget_conversation

    h = Harness()
    run(h, {"agent_id": "a", "messages": [user("secret")], "continue": True})
    assert h.store.caches["a"].conversation is not None  # the manifest's copy outlives the forget
    assert forget_conversation(h.redis, "a") is True
    assert h.producer.conversation("a") is None
    run(h, {"agent_id": "a", "messages": [user("fresh start")], "continue": True})
    contents = [m["content"] for m in h.producer.conversation("a") or () if m["role"] == "user"]
    assert contents == ["fresh start"]
    assert forget_conversation(h.redis, "nobody") is False


def test_a_new_agents_first_continue_starts_from_a_recent_prefix() -> None:
    h = Harness()
    system = {"role": "system", "content": "a long shared system prompt with tools " * 4}
    run(h, {"messages": [system, user("one-off")]})
    first = run(h, {"agent_id": "new", "messages": [system, user("hello")], "continue": True}).result()
    assert first.usage.reused_tokens > len(system["content"])  # the shared system prompt, not prefilled
