"""Codex CLI with a custom provider on the Responses API (`wire_api = "responses"`, Codex's only wire
API), `codex exec` then `codex exec resume --last` twice, against kvrq serve on the 32K-context
test model (Codex's request is ~9K SmolLM2 tokens, over the builtin's 8K): client_metadata, the
namespace tool group, the hosted web_search tool, store false and encrypted-reasoning include
accepted; every turn resumed through its prompt_cache_key (the thread id)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.clients import drivers
from tests.clients.models import ANSWER
from tests.clients.stack import ClientStack

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.clients]


def test_codex_exec_then_resume_last(long_stack: ClientStack, tmp_path: Path) -> None:
    session, outputs = drivers.codex(long_stack, tmp_path)
    assert all(output.strip().endswith(ANSWER) for output in outputs), outputs

    turns = session.check()
    sent = [e.body for e in session.exchanges() if e.path == "/v1/responses" and e.body]
    assert len(sent) == len(turns) == 3
    threads = {body["prompt_cache_key"] for body in sent}
    assert len(threads) == 1 and {turn.agent_id for turn in turns} == threads  # one agent: the thread
    for body in sent:  # what Codex sends that kvrq refused before, answered 2xx above
        assert body["store"] is False and "client_metadata" in body
        assert {tool["type"] for tool in body["tools"]} >= {"function", "namespace", "web_search"}
