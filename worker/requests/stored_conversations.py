"""Agents that remember: continue and fork jobs, and the conversation record every chat agent leaves.

A `continue` (or `fork_from`) job's prompt is not known when it is dequeued: it is the stored
conversation plus its own messages, and the stored conversation is only final once the agent's turn
is taken (the previous turn's cache and record are durable by then). So the loop holds such a job with
an empty prompt, and once its turn is taken:
1. `start_read` reads the source agent's whole cache (its own, or fork_from's) off the loop thread;
2. `resolve` takes the newer conversation of the cache manifest and the queue's Redis (by fence),
   and returns the whole request and the cache cut to what the rendered prompt shares with it.
When a chat job of an agent finishes, `record` writes the conversation with the answer appended to
the queue's Redis and returns the bytes the cache carries into its manifest: one record, two copies.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from redis import Redis

from engine.core.blocks import AgentCache, common_prefix_length
from producer.conversation import (
    ConversationRecord,
    after_turn,
    extended,
    newer,
    read_conversation,
    read_record,
    write_conversation,
)
from producer.models import ChatMessage, GenerationRequest, ToolCall
from worker.jobs.payload import JobRejected
from worker.loop.ports import Store


def source_agent(request: GenerationRequest) -> str:
    """The agent whose conversation the job extends."""
    source = request.fork_from or request.agent_id
    assert source is not None
    return source


def start_read(
    store: Store | None, request: GenerationRequest, fence: int | None, namespace: str | None
) -> Future[AgentCache | None]:
    """The source agent's whole cache (no prompt to cut it to yet), read off the loop thread; `fence`:
    the job's turn, when the source is its own agent (a fork reads another agent's last durable turn)."""
    if store is None:
        done: Future[AgentCache | None] = Future()
        done.set_result(None)
        return done
    own = request.fork_from is None
    source = source_agent(request)
    return store.prefetch(source, prompt_tokens=None, fence=fence if own else None, namespace=namespace)


def resolve(
    connection: Redis, request: GenerationRequest, cache: AgentCache | None, job_id: str
) -> tuple[GenerationRequest, ConversationRecord | None]:
    """The whole request (stored conversation + its messages) and the record it extends.

    JobRejected for a fork onto an agent that already has a conversation: forking must never
    overwrite an agent's memory.
    """
    assert request.agent_id is not None
    if request.fork_from is not None and read_conversation(connection, request.agent_id) is not None:
        raise JobRejected(
            f"invalid request: agent {request.agent_id!r} already has a conversation; fork onto a new agent "
            f"id, or delete it first (kvrq agent delete {request.agent_id})"
        )
    source = source_agent(request)
    stored = newer(
        read_record(connection, source),
        None if cache is None else ConversationRecord.decode(cache.conversation),
    )
    if stored is not None and stored.forgotten:
        stored = None  # reset or deleted after that cache was written
    if request.fork_from is not None and stored is None:
        raise JobRejected(
            f"invalid request: fork_from names agent {source!r}, which has no stored conversation "
            "(only chat jobs of an agent leave one)"
        )
    return extended(request, stored, job_id), stored


def reusable_part(cache: AgentCache | None, prompt_tokens: list[int]) -> AgentCache | None:
    """The part of `cache` the prompt can resume from (None: nothing)."""
    if cache is None:
        return None
    shared = cache.resume_point(common_prefix_length(cache.token_ids, prompt_tokens))
    return cache.truncated(shared) if shared > 0 else None


def context_message(request: GenerationRequest, n_tokens: int, reason: str) -> str:
    """Why a continued turn cannot run, and what the user can do about it."""
    agent = request.agent_id
    return (
        f"agent {agent!r}'s conversation with this turn is {n_tokens} tokens and cannot run: {reason}. "
        f"Start over (send continue: false with the messages to keep, or `kvrq generate --new`), reset the "
        f"agent (`kvrq agent reset {agent}`), or fork a shorter branch (fork_from) from an earlier agent"
    )


def answer_message(result: dict[str, Any]) -> ChatMessage:
    """The assistant message a finished job adds to its conversation (its text, calls and reasoning)."""
    calls = [ToolCall.model_validate(call) for call in result.get("tool_calls") or ()]
    text = str(result.get("text") or "")
    return ChatMessage(
        role="assistant",
        content=None if calls and not text else text,
        tool_calls=calls or None,
        reasoning=result.get("reasoning"),
    )


def record(
    connection: Redis,
    request: GenerationRequest,
    own_messages: int,
    result: dict[str, Any],
    fence: int | None,
) -> bytes | None:
    """Write the agent's conversation after this turn to the queue's Redis; the bytes its cache keeps.

    `request`: the whole conversation the job ran, its last `own_messages` the job's own. None for jobs
    that leave no conversation (no agent, or a raw prompt)."""
    if request.agent_id is None or request.messages is None:
        return None
    turn = after_turn(request, answer_message(result), fence or 0, str(result["job_id"]), own_messages)
    write_conversation(connection, request.agent_id, turn)
    return turn.encode()
