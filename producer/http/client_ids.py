"""Which agent a coding CLI's request belongs to, from the ids it sends anyway.

Claude Code names its session in `metadata.user_id` (a JSON string: device_id, account_uuid,
session_id) and in the `X-Claude-Code-Session-Id` header, and each subagent in an agent-id header;
Codex names its thread in `client_metadata` and `prompt_cache_key`. Any of them makes the request an
agent, so its next turn resumes its KV. A client id the agent-id rule would refuse (too long, another
character) is hashed into a valid one: the client cannot be told to send another, and the same id
always gives the same agent.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from producer.wire.ids import agent_id_problem

#: Claude Code's headers: a subagent's own id (parallel subagents are separate agents: each its own
#: cache and turn order), then the session's.
CLAUDE_AGENT_HEADERS = ("x-claude-code-agent-id", "x-claude-code-session-id")
#: Codex's client_metadata keys naming its conversation, most specific first.
CODEX_THREAD_KEYS = ("thread_id", "session_id", "conversation_id")


def valid_agent(client_id: str) -> str:
    """`client_id` where the agent-id rule takes it, else `h-` and the first 40 hex of its SHA-256."""
    if agent_id_problem(client_id) is None:
        return client_id
    return "h-" + hashlib.sha256(client_id.encode("utf-8", "surrogatepass")).hexdigest()[:40]


def claude_code_agent(user_id: Any, headers: Mapping[str, str]) -> str | None:
    """A subagent's header, else metadata.user_id (its session_id when it is Claude Code's JSON), else
    the session header; None when the request names none."""
    subagent = headers.get(CLAUDE_AGENT_HEADERS[0])
    if subagent:
        return valid_agent(subagent)
    if isinstance(user_id, str) and user_id:
        session = _json_field(user_id, "session_id")
        return valid_agent(session or user_id)
    session_header = headers.get(CLAUDE_AGENT_HEADERS[1])
    return valid_agent(session_header) if session_header else None


def codex_agent(client_metadata: Any) -> str | None:
    """The thread Codex names in `client_metadata` (None when it names none)."""
    if not isinstance(client_metadata, dict):
        return None
    for key in CODEX_THREAD_KEYS:
        value = client_metadata.get(key)
        if isinstance(value, str) and value:
            return valid_agent(value)
    return None


def _json_field(text: str, name: str) -> str | None:
    """`name` of `text` when it is a JSON object holding it as a non-empty string."""
    if not text.startswith("{"):
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    field = value.get(name) if isinstance(value, dict) else None
    return field if isinstance(field, str) and field else None
