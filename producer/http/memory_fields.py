"""The `kvrq` object a chat or messages request may carry beside the API's own fields.

`{"kvrq": {"continue": true}}` appends the request's messages to the agent's stored conversation
(the agent named by prompt_cache_key, metadata.user_id or X-Kvrq-Agent), so a client sends only the
new turn; `fork_from` starts the agent from another's conversation; `namespace` narrows the tenant.
The OpenAI SDK sends it with `extra_body={"kvrq": {...}}`, the Anthropic SDK with `extra_body` too.
"""

from __future__ import annotations

from typing import Any

from producer.http.conversations import reserved_agent
from producer.http.errors import invalid

FIELDS = ("continue", "fork_from", "namespace")


def memory_fields(body: dict[str, Any]) -> dict[str, Any]:
    """Pop `kvrq` from `body`; the GenerationRequest fields it sets (APIError 400 when malformed)."""
    extension = body.pop("kvrq", None)
    if extension is None:
        return {}
    if not isinstance(extension, dict) or set(extension) - set(FIELDS):
        raise invalid(f"'kvrq' is an object with the fields {', '.join(FIELDS)}", param="kvrq")
    if "continue" in extension and not isinstance(extension["continue"], bool):
        raise invalid("'kvrq.continue' must be true or false", param="kvrq.continue")
    if reserved_agent(extension.get("fork_from")):
        raise invalid(
            "'kvrq.fork_from' names a stored response's agent: use previous_response_id", param="kvrq"
        )
    return {name: value for name, value in extension.items() if value is not None}


def client_agent(agent: str | None, where: str) -> str | None:
    """The agent a chat or messages request names (`where`: which field), unless it is one of the
    Responses API's own: those are reached through their routes, which check who made them."""
    if reserved_agent(agent):
        raise invalid(f"{where} names a stored response's or conversation's agent: use the Responses API")
    return agent
