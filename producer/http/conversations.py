"""The state behind `previous_response_id` and the Conversations API: records in Redis, each pointing
at the agent whose conversation and KV the worker keeps.

A stored response is an agent of its own (`agent_of(response id)`): its job ran with `continue`
(a first turn) or `fork_from` the previous response's agent, so a follow-up forks that agent in turn
and sends only its new input; two follow-ups of one response branch without touching each other. A
conversation is one agent continued turn after turn (`continue`). The records keep what the API
answers (the Response object, the items) and what a later request is checked against (the call ids a
function_call_output may answer, the instructions in force); the conversation's messages and KV live
with the agent in the worker's store, so a follow-up resumes on any worker, after any restart.

Records belong to the tenant of the API key that made them (producer/tenants.py; a bare key's tenant is
its SHA-256, never the key): another tenant reads them as missing, the same answer as for an id that
never existed, and their agents are the tenant's qualified ones. Without keys there is one scope, ''.
"""

from __future__ import annotations

import hmac
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from redis import Redis
from starlette.types import Scope

from producer.conversation import forget_conversation
from producer.http.guard import request_tenant
from producer.tenants import Tenant
from producer.wire.protocol import conversation_items_key, conversation_key, response_key

#: Seconds a record lives after it was last written (OpenAI keeps responses 30 days).
RECORD_TTL_S = 30 * 24 * 3600
#: Most items one conversation listing returns.
MAX_LIST_LIMIT = 100


#: Agent ids of stored responses and conversations: only their own routes, which check the API key
#: that made them, may name them; a chat or messages request naming one is refused.
RESERVED_AGENT_PREFIXES = ("responses:", "conversations:")


def agent_of(ident: str) -> str:
    """The agent of a stored response or conversation (an agent id the worker keeps KV under)."""
    return f"{'responses' if ident.startswith('resp_') else 'conversations'}:{ident}"


def reserved_agent(agent_id: object) -> bool:
    """Whether a client-named agent id is one of the Responses API's own (refused on other routes)."""
    return isinstance(agent_id, str) and agent_id.startswith(RESERVED_AGENT_PREFIXES)


def scope_of(scope: Scope) -> str:
    """The owner of a request's records: the tenant of its API key, else (no keys) the one scope ''."""
    tenant = request_tenant(scope)
    return "" if tenant is None else tenant.name


def worker_agent(agent_id: str, owner: str) -> str:
    """The agent id the worker keeps a record's agent under: qualified for its owner's tenant."""
    return Tenant(owner).agent(agent_id) if owner else agent_id


@dataclass
class StoredResponse:
    owner: str
    agent_id: str
    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    #: Call ids of the function calls in the conversation up to this response (a later
    #: function_call_output may answer them).
    call_ids: list[str] = field(default_factory=list)
    instructions: str | None = None
    conversation: str | None = None


@dataclass
class StoredConversation:
    owner: str
    agent_id: str
    created_at: int
    metadata: dict[str, Any]
    #: Chat messages of the items it was created with, not yet in the agent's conversation: the first
    #: response on it sends them before its own input.
    pending: list[dict[str, Any]] = field(default_factory=list)
    call_ids: list[str] = field(default_factory=list)
    instructions: str | None = None

    def public(self, ident: str) -> dict[str, Any]:
        return {
            "id": ident,
            "object": "conversation",
            "created_at": self.created_at,
            "metadata": self.metadata,
        }


class Records:
    """Responses and conversations in Redis (blocking calls: run them with Bridge.run)."""

    def __init__(self, connection: Redis, ttl_s: int = RECORD_TTL_S) -> None:
        self.connection = connection
        self.ttl_s = ttl_s

    def response(self, ident: str, owner: str) -> StoredResponse | None:
        data = self._load(response_key(ident), owner)
        return None if data is None else StoredResponse(**data)

    def save_response(self, ident: str, record: StoredResponse) -> None:
        self.connection.set(response_key(ident), json.dumps(asdict(record)), ex=self.ttl_s)

    def delete_response(self, ident: str, owner: str) -> StoredResponse | None:
        """Remove the record and its agent's conversation record (a conversation's agent stays: other
        responses continue it). The agent's cache goes by the store's LRU (a producer has no store)."""
        record = self.response(ident, owner)
        if record is not None:
            self.connection.delete(response_key(ident))
            if record.conversation is None:
                self.forget_agent(record.agent_id, owner)
        return record

    def forget_agent(self, agent_id: str, owner: str) -> None:
        forget_conversation(self.connection, worker_agent(agent_id, owner))

    def conversation(self, ident: str, owner: str) -> StoredConversation | None:
        data = self._load(conversation_key(ident), owner)
        return None if data is None else StoredConversation(**data)

    def create_conversation(
        self, ident: str, record: StoredConversation, items: list[dict[str, Any]]
    ) -> None:
        self.extend_conversation(ident, record, items)

    def extend_conversation(
        self, ident: str, record: StoredConversation, items: list[dict[str, Any]]
    ) -> None:
        """Write the record and append `items` to its list, in one transaction."""
        with self.connection.pipeline() as pipe:
            pipe.set(conversation_key(ident), json.dumps(asdict(record)), ex=self.ttl_s)
            if items:
                pipe.rpush(conversation_items_key(ident), *(json.dumps(item) for item in items))
            pipe.expire(conversation_items_key(ident), self.ttl_s)
            pipe.execute()

    def delete_conversation(self, ident: str, owner: str) -> StoredConversation | None:
        record = self.conversation(ident, owner)
        if record is not None:
            self.connection.delete(conversation_key(ident), conversation_items_key(ident))
            self.forget_agent(record.agent_id, owner)
        return record

    def conversation_items(self, ident: str) -> list[dict[str, Any]]:
        raw = self.connection.lrange(conversation_items_key(ident), 0, -1)
        return [json.loads(item) for item in raw]

    def _load(self, key: str, owner: str) -> dict[str, Any] | None:
        raw = self.connection.get(key)
        if raw is None:
            return None
        data: dict[str, Any] = json.loads(raw)
        if not hmac.compare_digest(str(data.get("owner", "")).encode(), owner.encode()):
            return None
        return data


def new_conversation(owner: str, ident: str, metadata: dict[str, Any] | None) -> StoredConversation:
    return StoredConversation(owner, agent_of(ident), int(time.time()), metadata or {})


def item_page(
    items: list[dict[str, Any]], *, limit: int = 20, order: str = "desc", after: str | None = None
) -> dict[str, Any]:
    """A list of items as the Conversations API pages it: `order` asc or desc, `after` an item id."""
    ordered = items if order == "asc" else items[::-1]
    if after is not None:
        ids = [item.get("id") for item in ordered]
        ordered = ordered[ids.index(after) + 1 :] if after in ids else []
    page = ordered[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(ordered) > limit,
    }
