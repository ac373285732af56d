"""Agent ids as the store names them: never a path or key verbatim, only a hash of the id.

The rule an id must meet is the wire's (producer/wire/ids.py), checked once at the store's edge.
"""

from __future__ import annotations

import hashlib

from producer.wire.ids import validate_agent_id


def agent_key(agent_id: str) -> str:
    """The fixed-length hex name an agent's data lives under (40 hex chars of SHA-256)."""
    return hashlib.sha256(validate_agent_id(agent_id).encode()).hexdigest()[:40]
