"""Agent ids: the one rule producers, workers and stores check them by.

Ids travel in job payloads and Redis keys (`kvrq:agent-lock:<id>`); stores only ever use a hash of
one as a path or key (store/agent_ids.py), so an id like `../../etc/passwd` (refused here anyway)
or two that differ only in case cannot escape the store or collide on a case-insensitive disk.
"""

from __future__ import annotations

import re

MAX_AGENT_ID_LENGTH = 200
AGENT_ID_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._:@+=-]*"
_AGENT_ID = re.compile(AGENT_ID_PATTERN)


class InvalidAgentIdError(ValueError):
    """The agent id is empty, too long, or uses characters outside the safe set."""


def agent_id_problem(agent_id: object) -> str | None:
    """Why `agent_id` is not a valid agent id, or None when it is."""
    if not isinstance(agent_id, str):
        return f"agent id must be a string, not {type(agent_id).__name__}"
    if not agent_id or len(agent_id) > MAX_AGENT_ID_LENGTH:
        return f"agent id must be 1 to {MAX_AGENT_ID_LENGTH} characters, got {len(agent_id)}"
    if _AGENT_ID.fullmatch(agent_id) is None:
        return (
            f"agent id {agent_id!r} must start with a letter or digit and use only "
            "letters, digits and . _ : @ + = -"
        )
    return None


def validate_agent_id(agent_id: object) -> str:
    """Return `agent_id` if it is a safe id, else raise InvalidAgentIdError."""
    problem = agent_id_problem(agent_id)
    if problem is not None:
        raise InvalidAgentIdError(problem)
    assert isinstance(agent_id, str)
    return agent_id
