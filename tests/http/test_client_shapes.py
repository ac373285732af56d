"""Request bodies shaped as Claude Code 2.1, Codex CLI 0.17x and opencode 1.18 send them (captured on
the wire: ../shared/PLATFORM-NOTES.md, Round 5), through the parsers and the app without a worker
(fakeredis): accepted, honored where kvrq can, and what it does not act on named in x-kvrq-ignored."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from producer.http import anthropic_api, openai_api, pools, sse
from producer.http import responses_api as responses
from producer.http.app import STRICT_MAX_TOKENS_ENV, ServeSettings, create_app
from producer.http.client_ids import valid_agent
from producer.http.context_edits import CLEARED, apply_edits
from producer.http.errors import APIError
from producer.http.ignored import HEADER, collecting
from producer.http.model_cards import clamped_to
from producer.http.pools import Pool
from producer.models import GenerationRequest, GenerationResult
from producer.openai_shapes.bodies import CHAT_URL
from producer.wire.ids import agent_id_problem
from producer.wire.protocol import StreamEvent
from tests.http.test_fuzz import app_client, mutate  # noqa: F401  (app_client: the fixture)
from tests.producer.fakes import app_connections, fake_redis

SESSION = "5b0f3c1e-7d4a-4b8e-9c2f-1a2b3c4d5e6f"
BASH = {
    "name": "Bash",
    "description": "Run a shell command.",
    "input_schema": {
        "type": "object",
        "properties": {"command": {"type": "string"}},
        "required": ["command"],
        "additionalProperties": False,
        "$schema": "http://json-schema.org/draft-07/schema#",
    },
}


def claude_code_body(cch: str = "a1b2c", turns: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Claude Code 2.1's default /v1/messages body (shortened: one tool, short texts)."""
    return {
        "model": "smollm2-135m",
        "messages": turns
        or [
            {
                "role": "user",
                "content": [
                    {
                        "type": "text",
                        "text": "<system-reminder>\nAs you answer, use the tools.\n</system-reminder>",
                    },
                    {"type": "text", "text": "List the files.", "cache_control": {"type": "ephemeral"}},
                ],
            },
            {"role": "system", "content": "Available agent types: general-purpose."},
            {"role": "system", "content": [{"type": "text", "text": "Skills: none."}]},
        ],
        "system": [
            {
                "type": "text",
                "text": "x-anthropic-billing-header: cc_version=2.1.197.e3f; cc_entrypoint=sdk-cli; "
                f"cch={cch};",
            },
            {
                "type": "text",
                "text": "You are Claude Code, Anthropic's official CLI for Claude.",
                "cache_control": {"type": "ephemeral"},
            },
        ],
        "tools": [BASH, {"type": "web_search_20250305", "name": "web_search", "max_uses": 8}],
        "metadata": {
            "user_id": json.dumps({"device_id": "d" * 64, "account_uuid": "", "session_id": SESSION})
        },
        "max_tokens": 32000,
        "thinking": {"type": "adaptive"},
        "output_config": {"effort": "medium"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "stream": True,
    }


def codex_body() -> dict[str, Any]:
    """Codex CLI 0.171's /v1/responses body (shortened)."""
    return {
        "model": "smollm2-135m",
        "instructions": "You are Codex, a coding agent.",
        "input": [
            {
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "<permissions>"}],
            },
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Spawn a helper."}],
            },
        ],
        "tools": [
            {
                "type": "function",
                "name": "shell",
                "description": "Runs a shell command.",
                "strict": False,
                "parameters": {"type": "object", "properties": {"command": {"type": "array"}}},
            },
            {
                "type": "namespace",
                "name": "multi_agent_v1",
                "description": "Sub-agents.",
                "tools": [
                    {
                        "type": "function",
                        "name": "spawn_agent",
                        "description": "Start a sub-agent.",
                        "parameters": {
                            "type": "object",
                            "properties": {"task": {"type": "string"}},
                            "required": ["task"],
                            "additionalProperties": False,
                        },
                        "defer_loading": False,
                    }
                ],
            },
            {"type": "web_search", "external_web_access": False},
        ],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "019a7c2e-5f1d-7b3a-9e8c-0d1f2a3b4c5d",
        "client_metadata": {
            "installation_id": "i-1",
            "session_id": "s-1",
            "thread_id": "019a7c2e-5f1d-7b3a-9e8c-0d1f2a3b4c5d",
            "turn_id": "t-1",
        },
    }


# ---- Claude Code -------------------------------------------------------------------------------------


def test_claude_code_body_is_accepted_and_names_what_it_ignores() -> None:
    named = collecting()
    parsed = anthropic_api.parse(claude_code_body(), headers={"x-claude-code-session-id": SESSION})
    GenerationRequest.model_validate(parsed.fields)
    messages = parsed.fields["messages"]
    assert messages[0] == {
        "role": "system",
        "content": "You are Claude Code, Anthropic's official CLI for Claude.",
    }
    # the system messages after the last user turn become a user turn of their own
    assert messages[-1] == {
        "role": "user",
        "content": "Available agent types: general-purpose.\n\nSkills: none.",
    }
    assert [tool["function"]["name"] for tool in parsed.fields["tools"]] == ["Bash"]
    assert parsed.fields["agent_id"] == SESSION and parsed.stream
    assert parsed.fields["max_tokens"] == 32000 and parsed.fields["chat_template_kwargs"] == {
        "enable_thinking": True
    }
    assert named == ["system[0]", "tools.web_search", "output_config.effort"]


def test_a_changed_cch_leaves_the_prompt_unchanged() -> None:
    one = anthropic_api.parse(claude_code_body(cch="00001")).fields
    two = anthropic_api.parse(claude_code_body(cch="fffff")).fields
    assert one == two and "cch" not in json.dumps(one)


def test_mid_conversation_system_messages_fold_into_the_next_user_turn() -> None:
    turns: list[dict[str, Any]] = [
        {"role": "user", "content": "Hi"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "Bash", "input": {"command": "ls"}}],
        },
        {"role": "system", "content": "Skills: none."},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "a.txt"}]},
    ]
    messages = anthropic_api.parse(claude_code_body(turns=turns)).fields["messages"]
    assert messages[-2:] == [
        {"role": "tool", "tool_call_id": "t1", "content": "a.txt"},
        {"role": "user", "content": "Skills: none.\n\n"},
    ]


@pytest.mark.parametrize(
    ("user_id", "headers", "agent"),
    [
        (json.dumps({"device_id": "d", "account_uuid": "", "session_id": SESSION}), {}, SESSION),
        ("user_abc_account__session_" + SESSION, {}, "user_abc_account__session_" + SESSION),
        (None, {"x-claude-code-session-id": SESSION}, SESSION),
        (json.dumps({"session_id": SESSION}), {"x-claude-code-agent-id": "sub-7"}, "sub-7"),  # a subagent
        ("a user/with spaces", {}, valid_agent("a user/with spaces")),
    ],
)
def test_claude_code_ids_name_the_agent(user_id: str | None, headers: dict[str, str], agent: str) -> None:
    body = {**claude_code_body(), "metadata": {} if user_id is None else {"user_id": user_id}}
    named = anthropic_api.parse(body, headers=headers).fields["agent_id"]
    assert named == agent and agent_id_problem(named) is None


def test_an_id_the_agent_rule_refuses_is_hashed_the_same_each_time() -> None:
    bad = "x" * 300
    assert agent_id_problem(valid_agent(bad)) is None and valid_agent(bad) == valid_agent(bad) != bad


def test_count_tokens_takes_claude_codes_body_without_the_generation_fields() -> None:
    body = {key: value for key, value in claude_code_body().items() if key not in ("max_tokens", "stream")}
    parsed = anthropic_api.parse(body, count=True)
    assert "max_tokens" not in parsed.fields and parsed.fields["messages"][0]["role"] == "system"


def test_clear_thinking_keeps_the_last_turns_thinking() -> None:
    def turn(n: int) -> dict[str, Any]:
        return {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": f"t{n}", "signature": "s"},
                {"type": "text", "text": f"a{n}"},
            ],
        }

    messages = [{"role": "user", "content": "q"}, turn(1), {"role": "user", "content": "q"}, turn(2)]
    edits = {"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1}}]}
    edited, applied = apply_edits(edits, messages, 0)
    assert edited[1]["content"] == [{"type": "text", "text": "a1"}] and edited[3] == turn(2)
    assert applied[0]["cleared_thinking_turns"] == 1
    assert apply_edits({"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}, messages, 0) == (
        messages,
        [],
    )


def test_clear_tool_uses_clears_the_oldest_results_past_the_trigger() -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    for n in range(5):
        messages.append(
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": f"t{n}", "name": "Bash", "input": {"command": "ls"}}],
            }
        )
        messages.append(
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": f"t{n}", "content": "x" * 400}],
            }
        )
    edit = {
        "type": "clear_tool_uses_20250919",
        "trigger": {"type": "tool_uses", "value": 3},
        "keep": {"type": "tool_uses", "value": 2},
    }
    edited, applied = apply_edits({"edits": [edit]}, messages, 0)
    results = [
        m["content"][0]["content"] for m in edited if m["role"] == "user" and isinstance(m["content"], list)
    ]
    assert results == [CLEARED] * 3 + ["x" * 400] * 2
    assert applied == [
        {"type": "clear_tool_uses_20250919", "cleared_tool_uses": 3, "cleared_input_tokens": 3 * (402 // 4)}
    ]
    assert messages[2]["content"][0]["content"] == "x" * 400  # the request's own messages are not changed
    below = {**edit, "trigger": {"type": "tool_uses", "value": 5}}
    assert apply_edits({"edits": [below]}, messages, 0) == (messages, [])
    with pytest.raises(APIError):
        apply_edits({"edits": [{"type": "clear_everything"}]}, messages, 0)


def test_a_ping_is_anthropics_ping_event() -> None:
    stream = anthropic_api.MessageStream("j1", "m")
    assert stream.ping() == b'event: ping\ndata: {"type": "ping"}\n\n'


# ---- Codex ---------------------------------------------------------------------------------------------


def test_codex_body_is_accepted_with_namespaces_flattened_and_hosted_tools_named() -> None:
    named = collecting()
    parsed = responses.parse(codex_body())
    names = [tool["function"]["name"] for tool in parsed.fields["tools"]]
    assert names == ["shell", "multi_agent_v1.spawn_agent"]
    assert parsed.cache_key == "019a7c2e-5f1d-7b3a-9e8c-0d1f2a3b4c5d" and not parsed.store
    assert named == ["include", "client_metadata", "tools.web_search", "reasoning.summary"]
    GenerationRequest.model_validate({**parsed.fields, "messages": parsed.messages})


def test_codex_thread_id_names_the_agent_without_a_cache_key() -> None:
    body = {key: value for key, value in codex_body().items() if key != "prompt_cache_key"}
    assert responses.parse(body).cache_key == "019a7c2e-5f1d-7b3a-9e8c-0d1f2a3b4c5d"


def test_a_namespaced_call_goes_back_with_its_namespace_and_renders_flat_again() -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "multi_agent_v1.spawn_agent", "arguments": "{}"},
    }
    item = responses.call_item("fc_1", call, "completed")
    assert (item["name"], item["namespace"]) == ("spawn_agent", "multi_agent_v1")
    assert "namespace" not in responses.call_item(
        "fc_2", {**call, "function": {"name": "shell", "arguments": "{}"}}, "completed"
    )
    returned = {k: v for k, v in item.items() if k not in ("id", "status")}  # as Codex sends it back
    items = responses.input_items(
        [returned, {"type": "function_call_output", "call_id": "call_1", "output": "ok"}]
    )
    messages, _, _ = responses.chat_messages(items)
    assert messages[0]["tool_calls"][0]["function"]["name"] == "multi_agent_v1.spawn_agent"


# ---- through the app (no worker: the requests end 503, after their bodies were read) -----------------


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Pool]]:
    live: dict[str, Pool] = {"smollm2-135m": Pool("smollm2-135m", "kvrq", 1, context=8192)}
    monkeypatch.setattr(pools, "served_pools", lambda connection: dict(live))
    yield live


def client() -> TestClient:
    return TestClient(create_app(ServeSettings(), **app_connections()))


def test_root_answers_head_and_get() -> None:
    with client() as http:
        assert http.head("/").status_code == 200 and http.get("/").status_code == 200


def test_models_carry_the_context_clients_read(served: dict[str, Pool]) -> None:
    with client() as http:
        (card,) = http.get("/v1/models").json()["data"]
        assert card["context_length"] == card["context_window"] == card["max_model_len"] == 8192
        assert card["limit"] == {"context": 8192, "output": 8192}
        (anthropic,) = http.get("/v1/models", headers={"anthropic-version": "2023-06-01"}).json()["data"]
        assert anthropic["max_input_tokens"] == 8192


def test_the_ignored_header_names_what_each_api_ignored() -> None:
    """No worker: each request is read and parsed, then answered 503, with the header."""
    with client() as http:
        answer = http.post("/v1/messages?beta=true", json=claude_code_body())
        assert answer.status_code == 503
        assert answer.headers[HEADER] == "system[0],tools.web_search,output_config.effort"
        answer = http.post("/v1/responses", json=codex_body())
        assert answer.headers[HEADER] == "include,client_metadata,tools.web_search,reasoning.summary"
        plain = http.post(
            "/v1/messages", json={"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
        )
        assert HEADER not in plain.headers


def test_a_clamp_is_reported_only_when_the_context_cut_max_tokens() -> None:
    pool = Pool("m", "kvrq", 1, context=8192)
    usage = {"prompt_tokens": 2000, "reused_tokens": 0, "prefilled_tokens": 2000, "generated_tokens": 6}
    timings = {"queued_s": 0.0, "time_to_first_token_s": None, "total_s": 0.0}
    result = GenerationResult.model_validate(
        {
            "job_id": "j",
            "agent_id": None,
            "text": "",
            "token_ids": [],
            "finish_reason": "length",
            "usage": usage,
            "timings": timings,
        }
    )
    assert clamped_to(pool, 32000, result) == 6192
    assert clamped_to(pool, 100, result) is None
    assert clamped_to(Pool("m", "kvrq", 1), 32000, result) is None  # a worker that publishes no context


def test_system_messages_render_the_same_once_the_answer_is_appended() -> None:
    """Turn 1 ends with system messages (their own user turn); turn 2 appends the answer and a new
    user turn: the messages of turn 1 render unchanged, so turn 2 resumes all of turn 1."""
    first = claude_code_body()["messages"]
    turn_one = anthropic_api.parse(claude_code_body(turns=first)).fields["messages"]
    later = [*first, {"role": "assistant", "content": "Done."}, {"role": "user", "content": "Next."}]
    turn_two = anthropic_api.parse(claude_code_body(turns=later)).fields["messages"]
    assert turn_two[: len(turn_one)] == turn_one


# ---- opencode and other chat clients ---------------------------------------------------------------------


def test_chat_fields_that_change_nothing_are_named_and_reasoning_effort_is_honored() -> None:
    named = collecting()
    body = {
        "model": "smollm2-135m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 32000,
        "user": "u1",
        "store": False,
        "verbosity": "low",
        "web_search_options": {},
        "modalities": ["text"],
        "reasoning_effort": "none",
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    parsed = openai_api.parse(CHAT_URL, body)
    assert parsed.fields["chat_template_kwargs"] == {"enable_thinking": False}
    assert named == ["user", "store", "verbosity", "web_search_options"]
    GenerationRequest.model_validate(parsed.fields)
    with pytest.raises(APIError):  # audio out cannot be given: 400, not a text answer
        openai_api.parse(CHAT_URL, {**body, "modalities": ["text", "audio"]})


# ---- pings while the first token is still to come ---------------------------------------------------------


class SlowBridge:
    """A bridge whose job's first token comes after `delay` seconds, then ends."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.canceled: list[object] = []

    async def events(self, handle: object, *, timeout: float) -> AsyncIterator[StreamEvent]:
        await asyncio.sleep(self.delay)
        yield StreamEvent(kind="delta", text="Hi")
        yield StreamEvent(kind="end", finish_reason="stop")

    async def first(
        self,
        handle: object,
        events: AsyncIterator[StreamEvent],
        *,
        timeout: float,
        gone: Coroutine[Any, Any, Any],
    ) -> StreamEvent:
        gone.close()  # the client stays
        return await anext(events)

    async def result_after_end(self, handle: object) -> None:
        return None

    def cancel_soon(self, handle: object) -> None:
        self.canceled.append(handle)


async def _streamed(delay: float) -> list[str]:
    bridge = SlowBridge(delay)
    response = await sse.open_stream(
        bridge,  # type: ignore[arg-type]
        object(),  # type: ignore[arg-type]
        anthropic_api.MessageStream("j1", "m"),
        timeout=10,
        gone=asyncio.Event().wait(),
    )
    kinds = []
    async for chunk in response.body_iterator:
        text = chunk if isinstance(chunk, str) else bytes(chunk).decode()
        kinds.append(text.split("\n", 1)[0].removeprefix("event: "))
    return kinds


def test_a_slow_first_token_opens_the_anthropic_stream_with_pings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sse, "KEEPALIVE_S", 0.05)
    kinds = asyncio.run(_streamed(0.3))
    assert kinds[0] == "message_start" and kinds.count("message_start") == 1
    assert kinds[1] == "ping" and kinds.count("ping") >= 3
    assert kinds[-4:] == ["content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert asyncio.run(_streamed(0.0)).count("ping") == 0  # a prompt answered at once: no ping


def test_strict_max_tokens_restores_the_400(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ServeSettings().fit_max_tokens
    monkeypatch.setenv(STRICT_MAX_TOKENS_ENV, "1")
    assert not ServeSettings().fit_max_tokens


# ---- fuzzed client-shaped bodies -------------------------------------------------------------------------


def test_fuzzed_client_shaped_bodies_get_a_4xx_with_a_reason_or_an_answer(app_client: TestClient) -> None:  # noqa: F811
    """test_fuzz.py's mutations of these clients' bodies (context_management edits included): never a 5xx."""
    edits = {
        "edits": [
            {"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1}},
            {
                "type": "clear_tool_uses_20250919",
                "trigger": {"type": "tool_uses", "value": 0},
                "keep": {"type": "tool_uses", "value": 0},
                "exclude_tools": ["Read"],
                "clear_at_least": {"type": "input_tokens", "value": 0},
            },
        ]
    }
    turns: list[dict[str, Any]] = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "t", "signature": "s"},
                {"type": "tool_use", "id": "t1", "name": "Bash", "input": {"command": "ls"}},
            ],
        },
        {"role": "system", "content": "Skills: none."},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "a"}]},
    ]
    claude = {**claude_code_body(turns=turns), "stream": False, "context_management": edits}
    valid = {
        "/v1/messages": claude,
        "/v1/messages/count_tokens": {k: v for k, v in claude.items() if k not in ("max_tokens", "stream")},
        "/v1/responses": {**codex_body(), "stream": False},
    }
    for path, body in valid.items():
        assert app_client.post(path, json=body).status_code == 200, path
    for seed in range(1000):
        rng = random.Random(seed)
        path = rng.choice(sorted(valid))
        body = mutate(mutate(valid[path], rng), rng)
        raw = json.dumps(body).encode()  # NaN as JSON's NaN, as test_fuzz.py sends it
        answer = app_client.post(path, content=raw, headers={"content-type": "application/json"})
        assert answer.status_code == 200 or 400 <= answer.status_code < 500, (seed, path, raw, answer.text)


def test_a_streamed_answer_reports_the_clamp_in_a_header_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """The prompt's length is in the job's progress (the worker publishes it when it admits the job,
    before its first token), so a stream's headers carry the clamp as a plain answer's do."""
    from producer.aio import AsyncJobHandle
    from producer.http.bridge import Bridge
    from producer.http.model_cards import CLAMP_HEADER

    monkeypatch.setattr(pools, "served_pools", lambda connection: {"m": Pool("m", "kvrq", 1, context=8192)})
    redis = fake_redis()
    redis.hset("rq:job:job-1", "meta", json.dumps({"progress": {"prompt_tokens": 2000}}))

    async def submit(self: Bridge, request: GenerationRequest) -> AsyncJobHandle:
        return self.producer.handle("job-1")

    async def events(self: Bridge, handle: AsyncJobHandle, *, timeout: float) -> AsyncIterator[StreamEvent]:
        yield StreamEvent("delta", text="Hi")
        yield StreamEvent("end", finish_reason="length")

    async def after_end(self: Bridge, handle: AsyncJobHandle) -> None:
        return None

    for name, stand_in in [("submit", submit), ("events", events), ("result_after_end", after_end)]:
        monkeypatch.setattr(Bridge, name, stand_in)
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
    with TestClient(create_app(ServeSettings(), **app_connections(redis))) as http:
        cut = http.post(CHAT_URL, json={**chat, "max_tokens": 32000})
        kept = http.post(CHAT_URL, json={**chat, "max_tokens": 100})
        anthropic = http.post("/v1/messages", json={**chat, "max_tokens": 32000})
    assert cut.status_code == 200 and cut.headers[CLAMP_HEADER] == "6192"
    assert kept.status_code == 200 and CLAMP_HEADER not in kept.headers
    assert anthropic.status_code == 200 and anthropic.headers[CLAMP_HEADER] == "6192"
