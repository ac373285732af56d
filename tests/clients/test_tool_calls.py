"""Issue 42 items 1 and 8: Claude Code, Codex and opencode, unmodified and in their default
configuration, offered their own tools through kvrq serve; the model calls the CLI's shell tool
(`cat giraffe.txt` in the session's folder), the CLI runs it and sends the result back, and the model
ends with `Done` (tests/clients/models.py's tool-call model, 32K context). Each test asserts, from
the requests recorded, that the first answer carried the call in its API's shape, that the next
request carried the tool's output for that call id, that the final answer is `Done`, and that the
second request resumed the first's KV."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.clients import drivers
from tests.clients.models import FINAL, MARKER, tool_call_text, write_tool_call_model
from tests.clients.proxy import Exchange
from tests.clients.reuse import Turn
from tests.clients.session import Session
from tests.clients.stack import ClientStack

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.clients]

COMMAND = f"cat{MARKER}.txt"
#: What the file holds: seen in a tool result only if the CLI ran the command.
CONTENT = "kvrq tool result 4417"
PROMPT = "Show me the notes."

StackFor = Callable[[str, dict[str, Any]], ClientStack]


@pytest.fixture(scope="module")
def stack_for(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackFor]:
    """A stack on a tool-call model per call, written and started once (each CLI's tool differs)."""
    stacks: dict[str, ClientStack] = {}

    def get(name: str, arguments: dict[str, Any]) -> ClientStack:
        call = tool_call_text(name, arguments)
        if call not in stacks:
            folder = write_tool_call_model(tmp_path_factory.mktemp("models") / f"call-{name}", call)
            stacks[call] = ClientStack(str(folder), tmp_path_factory.mktemp(f"clients-call-{name}")).start()
        return stacks[call]

    try:
        yield get
    finally:
        for stack in stacks.values():
            stack.stop()


def _session(stack: ClientStack, tmp: Path) -> Session:
    session = Session(stack, tmp / "work")
    (session.workdir / f"{MARKER.strip()}.txt").write_text(CONTENT + "\n")
    return session


def _answer(exchange: Exchange) -> list[dict[str, Any]]:
    """The answer's JSON: each `data:` payload of a stream, else the body."""
    text = b"".join(chunk for _, chunk in exchange.received).decode()
    if "data:" not in text:
        return [json.loads(text)]
    return [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:") and "{" in line]


def _body(exchange: Exchange) -> dict[str, Any]:
    assert exchange.body is not None, exchange.brief()
    return exchange.body


def _resumed(session: Session) -> list[Turn]:
    """Every request 2xx and resumed enough (session.check); the job after the call's resumed at
    least 95% of the call's prompt. The agent's jobs are those offered tools (not opencode's title)."""
    turns = session.check(min_jobs=2)
    jobs = session.stack.finished_jobs(session.started)
    agent = [turn for turn, job in zip(turns, jobs, strict=True) if job.request.tools]
    assert len(agent) >= 2, turns
    assert agent[1].reused_tokens >= 0.95 * agent[0].prompt_tokens, turns
    return agent


def test_claude_code_runs_bash_and_sends_the_result_back(stack_for: StackFor, tmp_path: Path) -> None:
    stack = stack_for("Bash", {"command": COMMAND})
    session = _session(stack, tmp_path)
    env = drivers.claude_env(stack, tmp_path / "home")
    options = ["--model", stack.model, "--output-format", "json"]
    out = json.loads(session.run([drivers.client_program("claude"), "-p", PROMPT, *options], env))
    assert out["is_error"] is False and out["result"] == FINAL, out

    sent = [e for e in session.exchanges() if e.path.startswith("/v1/messages?") and e.body]
    assert len(sent) == 2, session.requests_brief()
    assert MARKER.strip() not in json.dumps(sent[0].body)  # else the model would not call
    blocks = [e["content_block"] for e in _answer(sent[0]) if e.get("type") == "content_block_start"]
    (use,) = [block for block in blocks if block["type"] == "tool_use"]
    arguments = "".join(
        e["delta"]["partial_json"]
        for e in _answer(sent[0])
        if e.get("type") == "content_block_delta" and e["delta"]["type"] == "input_json_delta"
    )
    assert use["name"] == "Bash" and json.loads(arguments) == {"command": COMMAND}
    assert any(e.get("delta", {}).get("stop_reason") == "tool_use" for e in _answer(sent[0]))

    results = [
        block
        for message in _body(sent[1])["messages"]
        if message["role"] == "user" and isinstance(message["content"], list)
        for block in message["content"]
        if block.get("type") == "tool_result"
    ]
    (result,) = results
    assert result["tool_use_id"] == use["id"] and CONTENT in json.dumps(result["content"]), result
    _resumed(session)


def test_codex_runs_exec_command_and_sends_the_output_back(stack_for: StackFor, tmp_path: Path) -> None:
    stack = stack_for("exec_command", {"cmd": COMMAND})
    session = _session(stack, tmp_path)
    base, env = drivers.codex_exec(stack, tmp_path / "home")
    output = session.run([*base, PROMPT], env)
    assert output.strip().endswith(FINAL), output

    sent = [e for e in session.exchanges() if e.path == "/v1/responses" and e.body]
    assert len(sent) == 2, session.requests_brief()
    assert MARKER.strip() not in json.dumps(sent[0].body)
    done = [e["item"] for e in _answer(sent[0]) if e.get("type") == "response.output_item.done"]
    (call,) = [item for item in done if item["type"] == "function_call"]
    assert call["name"] == "exec_command" and json.loads(call["arguments"]) == {"cmd": COMMAND}

    items = [item for item in _body(sent[1])["input"] if isinstance(item, dict)]
    assert any(item.get("type") == "function_call" and item["call_id"] == call["call_id"] for item in items)
    (result,) = [item for item in items if item.get("type") == "function_call_output"]
    assert result["call_id"] == call["call_id"] and CONTENT in json.dumps(result["output"]), result
    _resumed(session)


def test_opencode_runs_bash_and_sends_the_result_back(stack_for: StackFor, tmp_path: Path) -> None:
    stack = stack_for("bash", {"command": COMMAND})
    session = _session(stack, tmp_path)
    env = drivers.isolated_env(tmp_path / "home")
    drivers.write_opencode_config(stack, session.workdir)
    argv: list[str | Path] = [drivers.client_program("opencode"), "run", "--format", "json", PROMPT]
    out = [
        json.loads(line) for line in session.run(argv, env, timeout=240).splitlines() if line.startswith("{")
    ]
    texts = [event["part"]["text"] for event in out if event.get("type") == "text"]
    assert texts and texts[-1].strip() == FINAL, out

    sent = [e for e in session.exchanges() if e.body and e.body.get("tools")]  # the agent's, not the title's
    assert len(sent) == 2, session.requests_brief()
    assert MARKER.strip() not in json.dumps(sent[0].body)
    deltas = [
        call
        for chunk in _answer(sent[0])
        for choice in chunk.get("choices", [])
        for call in choice["delta"].get("tool_calls") or []
    ]
    call_id = deltas[0]["id"]
    name = "".join(d["function"].get("name") or "" for d in deltas)
    arguments = "".join(d["function"].get("arguments") or "" for d in deltas)
    assert name == "bash" and json.loads(arguments) == {"command": COMMAND}

    messages = _body(sent[1])["messages"]
    assert any(call["id"] == call_id for m in messages for call in m.get("tool_calls") or [])
    (result,) = [m for m in messages if m["role"] == "tool"]
    assert result["tool_call_id"] == call_id and CONTENT in json.dumps(result["content"]), result
    _resumed(session)
