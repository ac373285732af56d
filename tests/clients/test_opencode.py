"""opencode with an `@ai-sdk/openai-compatible` provider and its default limits (32,000 output
tokens) against kvrq serve on an 8K-context test model: `opencode run`, `--continue`, `--session`.
Its requests overflow the context with that output limit; it once looped compacting and retrying on
the 400. Each run must end within a bounded number of requests (drivers.opencode asserts it as each
run ends, and the run's timeout bounds a loop), and, with no cache key sent, every request resume
by token prefix."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.clients import drivers
from tests.clients.stack import ClientStack

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.clients]


def test_opencode_run_continue_session(short_stack: ClientStack, tmp_path: Path) -> None:
    session, counts = drivers.opencode(short_stack, tmp_path)
    assert len(counts) == 3 and max(counts) <= drivers.OPENCODE_MAX_REQUESTS_PER_RUN

    session.check()
    agent_requests = [e.body for e in session.exchanges() if e.body and e.body.get("tools")]
    assert agent_requests and all(body["max_tokens"] == 32000 for body in agent_requests)
    assert not any("prompt_cache_key" in body for body in agent_requests)  # reuse by prefix alone
