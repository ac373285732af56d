"""Claude Code, its default configuration (no workaround env vars), `claude -p` then `--continue` then
`--resume`, against kvrq serve on the 32K-context test model: its ~21K-token default request, with
its 24 tools, thinking, effort, context_management, mid-conversation system messages and billing
block, accepted and streamed; the session resumed from the KV each turn."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.clients import drivers
from tests.clients.models import ANSWER
from tests.clients.stack import ClientStack

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.clients]


def test_claude_code_print_continue_resume(long_stack: ClientStack, tmp_path: Path) -> None:
    session, answers = drivers.claude_code(long_stack, tmp_path)
    for answer in answers:
        assert answer["is_error"] is False and answer["result"] == ANSWER, answer
    assert len({answer["session_id"] for answer in answers}) == 1

    turns = session.check()
    assert turns[0].prompt_tokens > 16_000  # the full default request, not a trimmed one
    assert {turn.agent_id for turn in turns} == {answers[0]["session_id"]}  # metadata.user_id's session_id
    sent = [e.body for e in session.exchanges() if e.path.startswith("/v1/messages") and e.body]
    assert len(sent) == len(turns)
    for body in sent:  # what made it fail before: sent, and answered 2xx above
        assert body["max_tokens"] == 32000 and "context_management" in body and len(body["tools"]) > 10
