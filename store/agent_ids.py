"""Agent ids: checked once at the store's edge, and never used as a path or key verbatim.

An id is at most 200 characters from a conservative set (the rule producers validate with too);
on disk and in Redis it is only ever represented by a hash of it, so ids like `../../etc/passwd`
(rejected anyway) or ones that differ only in case cannot escape the store or collide on a
case-insensitive filesystem.
"""

from __future__ import annotations

import hashlib
import re

#: The same rule as the wire's (producer/protocol.py): store may not import producer, so it keeps a
#: copy, and tests/store/test_agent_id_rule.py fails when the two differ.
MAX_AGENT_ID_LENGTH = 200
AGENT_ID_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._:@+=-]*"
_AGENT_ID = re.compile(AGENT_ID_PATTERN)


class InvalidAgentIdError(ValueError):
    """The agent id is empty, too long, or uses characters outside the safe set."""


def validate_agent_id(agent_id: object) -> str:
    """Return `agent_id` if it is a safe id, else raise InvalidAgentIdError."""
    if not isinstance(agent_id, str):
        raise InvalidAgentIdError(f"agent id must be a string, not {type(agent_id).__name__}")
    if not agent_id or len(agent_id) > MAX_AGENT_ID_LENGTH:
        raise InvalidAgentIdError(
            f"agent id must be 1 to {MAX_AGENT_ID_LENGTH} characters, got {len(agent_id)}"
        )
    if _AGENT_ID.fullmatch(agent_id) is None:
        raise InvalidAgentIdError(
            f"agent id {agent_id!r} must start with a letter or digit and use only "
            "letters, digits and . _ : @ + = -"
        )
    return agent_id


def agent_key(agent_id: str) -> str:
    """The fixed-length hex name an agent's data lives under (40 hex chars of SHA-256)."""
    return hashlib.sha256(validate_agent_id(agent_id).encode()).hexdigest()[:40]
