"""Claude Code, its default configuration (no workaround env vars), `claude -p` then `--continue` then
`--resume`, against kvrq serve on the 32K-context test model: its ~21K-token default request, with
its 24 tools, thinking, effort, context_management, mid-conversation system messages and billing
block, accepted and streamed; the session resumed from the KV each turn."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.clients.conftest import client_program, isolated_env
from tests.clients.models import ANSWER
from tests.clients.session import Session
from tests.clients.stack import ClientStack

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.clients]


def test_claude_code_print_continue_resume(long_stack: ClientStack, tmp_path: Path) -> None:
    claude = client_program("claude")
    home = tmp_path / "home"
    env = isolated_env(
        home,
        CLAUDE_CONFIG_DIR=str(home / ".claude"),
        ANTHROPIC_BASE_URL=long_stack.url,
        ANTHROPIC_API_KEY="unused",
        DISABLE_TELEMETRY="1",
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
    )
    session = Session(long_stack, tmp_path / "work")
    options = ["--model", long_stack.model, "--output-format", "json"]

    def turn(*args: str) -> dict[str, Any]:
        answer = json.loads(session.run([claude, "-p", *args, *options], env))
        assert answer["is_error"] is False and answer["result"] == ANSWER, answer
        return answer

    first = turn("What is in this folder?")
    second = turn("And what should I do next?", "--continue")
    third = turn("Thanks.", "--resume", first["session_id"])
    assert first["session_id"] == second["session_id"] == third["session_id"]

    turns = session.check()
    assert turns[0].prompt_tokens > 16_000  # the full default request, not a trimmed one
    assert {turn.agent_id for turn in turns} == {first["session_id"]}  # metadata.user_id's session_id
    sent = [e.body for e in session.exchanges() if e.path.startswith("/v1/messages") and e.body]
    assert len(sent) == len(turns)
    for body in sent:  # what made it fail before: sent, and answered 2xx above
        assert body["max_tokens"] == 32000 and "context_management" in body and len(body["tools"]) > 10
