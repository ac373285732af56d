"""The store's agent-id rule (store/agent_ids.py) and the wire's (producer/protocol.py) are one rule.

The store may not import the producer package, so it keeps a copy; this test fails when they drift.
"""

from __future__ import annotations

import pytest

from producer import protocol
from store import agent_ids

SAMPLES = [
    "a",
    "agent-1",
    "user:42:agent",
    "A.b_c@d+e=f",
    "x" * 200,
    "x" * 201,
    "",
    "-lead",
    ".hidden",
    "../x",
    "a/b",
    "a b",
    "a\nb",
    "ağ",
    "a\x00b",
    "~root",
]


def test_the_pattern_and_the_length_limit_are_the_same() -> None:
    assert agent_ids.AGENT_ID_PATTERN == protocol.AGENT_ID_PATTERN
    assert agent_ids.MAX_AGENT_ID_LENGTH == protocol.MAX_AGENT_ID_LENGTH


@pytest.mark.parametrize("agent_id", SAMPLES)
def test_both_sides_accept_and_reject_the_same_ids(agent_id: str) -> None:
    wire_accepts = protocol.agent_id_problem(agent_id) is None
    try:
        agent_ids.validate_agent_id(agent_id)
        store_accepts = True
    except agent_ids.InvalidAgentIdError:
        store_accepts = False
    assert wire_accepts == store_accepts
