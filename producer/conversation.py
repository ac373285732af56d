"""An agent's stored conversation: what a `continue` job appends to, and how anyone reads it back.

The worker keeps the record in two places, both stamped with the fence of the turn that wrote it:
- inside the agent's cache manifest (AgentCache.conversation), so messages and KV are one unit;
- in the queue's Redis (`agent_conversation_key`), so producers read it without the store, and so an
  agent whose cache was evicted or damaged still remembers (it re-prefills instead of forgetting).
A reader takes the newer of the two by fence; reuse of the KV is by token prefix, so a cache one turn
older than its conversation only costs prefill, never a wrong answer.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from redis import Redis
from redis.exceptions import WatchError

from producer.models import ChatMessage, GenerationRequest, Tool
from producer.wire.protocol import agent_conversation_key, agent_fence_key


class ConversationRecord(BaseModel):
    """The messages of an agent so far, and the tools and template options in force."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    fence: int = Field(ge=0, description="the agent's turn that wrote it (producer/protocol: fencing)")
    job_id: str = Field(default="", description="the job whose turn wrote it")
    base: int = Field(default=0, ge=0, description="messages before that job's own (a re-run starts there)")
    messages: list[ChatMessage] = Field(default_factory=list)
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    forgotten: bool = Field(default=False, description="a tombstone: the conversation was reset or deleted")

    def encode(self) -> bytes:
        return self.model_dump_json(exclude_none=True).encode()

    @classmethod
    def decode(cls, data: bytes | str | None) -> ConversationRecord | None:
        """The record in `data`; None for nothing or anything unreadable (treated as no conversation)."""
        if not data:
            return None
        try:
            return cls.model_validate_json(data)
        except ValidationError:
            return None

    def message_dicts(self) -> list[dict[str, Any]]:
        """The messages in OpenAI's chat shape."""
        return [m.model_dump(mode="json", exclude_none=True) for m in self.messages]


def newer(*records: ConversationRecord | None) -> ConversationRecord | None:
    """The record written by the latest turn (the first of equals)."""
    found = [r for r in records if r is not None]
    return max(found, key=lambda r: r.fence) if found else None


def extended(request: GenerationRequest, stored: ConversationRecord | None, job_id: str) -> GenerationRequest:
    """`request` with the stored messages before its own; its tools and template options replace the
    stored ones when it sends any. Not validated again: a long conversation may pass the per-request
    message limits, and its context length is what bounds it (checked once rendered).

    A job re-run after its worker died may have written its turn already: it starts again from the
    messages before its own, so a crash never appends a turn twice."""
    assert request.messages is not None
    if stored is None:
        return request
    before = stored.messages[: stored.base] if stored.job_id == job_id else stored.messages
    return request.model_copy(
        update={
            "messages": [*before, *request.messages],
            "tools": request.tools if request.tools is not None else stored.tools,
            "chat_template_kwargs": request.chat_template_kwargs
            if request.chat_template_kwargs is not None
            else stored.chat_template_kwargs,
        }
    )


def after_turn(
    request: GenerationRequest, answer: ChatMessage, fence: int, job_id: str, own_messages: int
) -> ConversationRecord:
    """The record once `request` (its whole conversation, the last `own_messages` sent by job
    `job_id`) got `answer`."""
    assert request.messages is not None
    return ConversationRecord(
        fence=fence,
        job_id=job_id,
        base=len(request.messages) - own_messages,
        messages=[*request.messages, answer],
        tools=request.tools,
        chat_template_kwargs=request.chat_template_kwargs,
    )


def read_record(connection: Redis, agent_id: str) -> ConversationRecord | None:
    """The agent's record as the queue's Redis holds it, a tombstone included."""
    return ConversationRecord.decode(connection.get(agent_conversation_key(agent_id)))


def read_conversation(connection: Redis, agent_id: str) -> ConversationRecord | None:
    """The agent's conversation (None: none, or forgotten)."""
    record = read_record(connection, agent_id)
    return None if record is None or record.forgotten else record


def write_conversation(connection: Redis, agent_id: str, record: ConversationRecord) -> bool:
    """Store `record` unless a later turn's is there already (a stalled worker never rolls an agent
    back); False when it was older."""
    key = agent_conversation_key(agent_id)
    with connection.pipeline() as pipe:
        while True:
            try:
                pipe.watch(key)
                current = ConversationRecord.decode(pipe.get(key))
                if current is not None and current.fence > record.fence:
                    pipe.unwatch()
                    return False
                pipe.multi()
                pipe.set(key, record.encode())
                pipe.execute()
                return True
            except WatchError:
                continue


#: How long a tombstone outlives the conversation it ends (the cache's copy is evicted long before).
TOMBSTONE_TTL_S = 90 * 24 * 3600


def forget_conversation(connection: Redis, agent_id: str) -> bool:
    """End the agent's conversation; True if it had one.

    A tombstone stamped with a fresh fence replaces the record, not a delete: the copy in the agent's
    cache manifest (evicted later, by the store's LRU) is older, so it can never bring the conversation
    back, and a turn still running with an older fence cannot write it back either."""
    had = read_conversation(connection, agent_id) is not None
    fence = int(connection.incr(agent_fence_key(agent_id)))
    write_conversation(connection, agent_id, ConversationRecord(fence=fence, forgotten=True))
    connection.expire(agent_conversation_key(agent_id), TOMBSTONE_TTL_S)
    return had
