"""opencode with an `@ai-sdk/openai-compatible` provider and its default limits (32,000 output
tokens) against kvrq serve on an 8K-context test model: `opencode run`, `--continue`, `--session`.
Its requests overflow the context with that output limit; it once looped compacting and retrying on
the 400. Each run must end within a bounded number of requests, and, with no cache key sent, every
request resume by token prefix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.clients.conftest import client_program, isolated_env
from tests.clients.session import Session
from tests.clients.stack import ClientStack

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.clients]

#: Requests one `opencode run` makes: its title request and its agent request (a tool loop would add
#: some, a compaction loop many more).
MAX_REQUESTS_PER_RUN = 4


def config(url: str, model: str) -> dict[str, object]:
    provider = {
        "npm": "@ai-sdk/openai-compatible",
        "name": "kvrq",
        "options": {"baseURL": f"{url}/v1", "apiKey": "unused"},
        "models": {model: {"name": "kvrq test model"}},  # no limit: opencode's defaults
    }
    return {
        "provider": {"kvrq": provider},
        "model": f"kvrq/{model}",
        "autoupdate": False,
        "share": "disabled",
    }


def test_opencode_run_continue_session(short_stack: ClientStack, tmp_path: Path) -> None:
    opencode = client_program("opencode")
    env = isolated_env(tmp_path / "home")
    session = Session(short_stack, tmp_path / "work")
    (session.workdir / "opencode.json").write_text(json.dumps(config(short_stack.url, short_stack.model)))

    def run(*args: str) -> list[dict[str, object]]:
        before = len(session.exchanges())
        out = session.run([opencode, "run", "--format", "json", *args], env, timeout=240)
        assert len(session.exchanges()) - before <= MAX_REQUESTS_PER_RUN, session.requests_brief()
        return [json.loads(line) for line in out.splitlines() if line.startswith("{")]

    first = run("What is in this folder?")
    run("--continue", "And what next?")
    ids = {event["sessionID"] for event in first if "sessionID" in event}
    assert len(ids) == 1, first
    run("--session", ids.pop(), "Thanks.")

    session.check()
    agent_requests = [e.body for e in session.exchanges() if e.body and e.body.get("tools")]
    assert agent_requests and all(body["max_tokens"] == 32000 for body in agent_requests)
