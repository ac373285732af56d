"""The routes of OpenAI's Responses and Conversations APIs: `/v1/responses` (create, get, delete, input
items) and `/v1/conversations` (create, get, update, delete, items).

A request is checked whole before its job is enqueued (the previous response or the conversation
exists and is the caller's, each function_call_output answers a call it can see), and its records are
written only once its job has a result: a request that fails stores nothing. conversations.py says
what a stored response and a conversation are (an agent each).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from producer.http import responses_api as api
from producer.http.conversations import (
    MAX_LIST_LIMIT,
    Records,
    StoredConversation,
    StoredResponse,
    agent_of,
    item_page,
    new_conversation,
    scope_of,
)
from producer.http.errors import invalid
from producer.models import GenerationResult

if TYPE_CHECKING:
    from producer.http.app import _Front as Front

BodyReader = Callable[[Request], Awaitable[dict[str, Any]]]


@dataclass
class Plan:
    """One /v1/responses request, checked against the state it builds on, ready to enqueue."""

    response_id: str
    owner: str
    parsed: api.Parsed
    fields: dict[str, Any]
    known_calls: set[str] = field(default_factory=set)
    instructions: str | None = None  # in force after this response
    conversation_id: str | None = None
    conversation: StoredConversation | None = None
    created_at: int = field(default_factory=lambda: int(time.time()))

    @property
    def agent_id(self) -> str | None:
        return self.fields.get("agent_id")


class ResponsesAPI:
    def __init__(self, front: Front, records: Records, read_body: BodyReader) -> None:
        self.front = front
        self.bridge = front.bridge
        self.records = records
        self.read_body = read_body

    def owner(self, request: Request) -> str:
        return scope_of(request.scope)

    # ---- /v1/responses ----

    async def create(self, request: Request) -> Response:
        parsed = api.parse(await self.read_body(request))
        plan = await self.bridge.run(self.plan, parsed, self.owner(request))
        pool, handle = await self.front.submit(request, parsed.model, plan.fields)
        conversation = plan.conversation_id
        stream = (
            api.ResponseStream(
                plan.response_id, pool.model, parsed.echo, conversation, created_at=plan.created_at
            )
            if parsed.stream
            else None
        )
        answered: dict[str, dict[str, Any]] = {}

        async def keep(result: GenerationResult | None) -> None:
            if result is None:
                return
            if stream is not None:
                final = stream.finish(result)
            else:
                final = api.response_object(
                    plan.response_id,
                    pool.model,
                    parsed.echo,
                    created_at=plan.created_at,
                    output=api.output_items(result),
                    status=api.status_of(result),
                    result=result,
                    conversation=conversation,
                )
            await self.bridge.run(self.keep, plan, final)
            answered["body"] = final

        return await self.front.answer(request, handle, stream, lambda _: answered["body"], keep)

    def plan(self, parsed: api.Parsed, owner: str) -> Plan:
        """The job of a request: the previous response's agent forked, the conversation's continued,
        or a new agent started (`store`); the messages it appends. APIError 400/404 when it cannot run."""
        plan = Plan(api.new_id("resp"), owner, parsed, dict(parsed.fields))
        before: str | None = None
        if parsed.previous_response_id is not None:
            previous = self.records.response(parsed.previous_response_id, owner)
            if previous is None:
                raise api.not_found(
                    "Previous response", parsed.previous_response_id, status=400, param="previous_response_id"
                )
            if previous.conversation is not None:
                raise invalid(
                    f"response {parsed.previous_response_id!r} belongs to conversation "
                    f"{previous.conversation!r}: continue it with 'conversation'",
                    param="previous_response_id",
                )
            plan.known_calls, before = set(previous.call_ids), previous.instructions
            plan.fields.update(agent_id=agent_of(plan.response_id), fork_from=previous.agent_id)
        elif parsed.conversation is not None:
            conversation = self.records.conversation(parsed.conversation, owner)
            if conversation is None:
                raise api.not_found("Conversation", parsed.conversation, status=404, param="conversation")
            plan.conversation_id, plan.conversation = parsed.conversation, conversation
            plan.known_calls, before = set(conversation.call_ids), conversation.instructions
            plan.fields.update(agent_id=conversation.agent_id, **{"continue": True})
        elif parsed.store:
            plan.fields.update(agent_id=agent_of(plan.response_id), **{"continue": True})
        elif parsed.cache_key is not None:
            plan.fields["agent_id"] = parsed.cache_key
        if missing := [call for call in parsed.answered if call not in plan.known_calls]:
            where = "the previous response" if parsed.previous_response_id else "the conversation"
            raise invalid(
                f"no function_call with call_id {missing[0]!r} for its function_call_output, "
                f"neither in the input nor in {where}",
                param="input",
            )
        messages = list(plan.conversation.pending) if plan.conversation is not None else []
        if parsed.instructions is not None and parsed.instructions != before:
            messages.insert(0, {"role": "system", "content": parsed.instructions})
        plan.fields["messages"] = messages + parsed.messages
        plan.instructions = parsed.instructions or before
        return plan

    def keep(self, plan: Plan, final: dict[str, Any]) -> None:
        """Write the records of a request whose job has its result."""
        parsed = plan.parsed
        calls = sorted(plan.known_calls | parsed.calls | api.call_ids(final["output"]))
        if not parsed.store and parsed.previous_response_id is not None and plan.agent_id is not None:
            self.records.forget_agent(plan.agent_id, plan.owner)  # the fork no later request can name
        if parsed.store and plan.agent_id is not None:
            record = StoredResponse(
                plan.owner,
                plan.agent_id,
                final,
                parsed.items,
                calls,
                plan.instructions,
                plan.conversation_id,
            )
            self.records.save_response(plan.response_id, record)
        if plan.conversation is not None and plan.conversation_id is not None:
            conversation = plan.conversation
            conversation.pending, conversation.call_ids = [], calls
            conversation.instructions = plan.instructions
            self.records.extend_conversation(
                plan.conversation_id, conversation, parsed.items + final["output"]
            )

    async def get(self, request: Request, response_id: str) -> Response:
        record = await self.bridge.run(self.records.response, response_id, self.owner(request))
        if record is None:
            raise api.not_found("Response", response_id, status=404)
        return JSONResponse(record.response)

    async def input_items(self, request: Request, response_id: str) -> Response:
        record = await self.bridge.run(self.records.response, response_id, self.owner(request))
        if record is None:
            raise api.not_found("Response", response_id, status=404)
        return JSONResponse(item_page(record.input_items, **_paging(request, default_order="asc")))

    async def delete(self, request: Request, response_id: str) -> Response:
        record = await self.bridge.run(self.records.delete_response, response_id, self.owner(request))
        if record is None:
            raise api.not_found("Response", response_id, status=404)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    # ---- /v1/conversations ----

    async def create_conversation(self, request: Request) -> Response:
        body = await self.read_body(request)
        if unknown := sorted(set(body) - {"items", "metadata"}):
            raise invalid(f"unknown field(s) {', '.join(unknown)} (a conversation takes items and metadata)")
        ident, owner = api.new_id("conv"), self.owner(request)
        record = new_conversation(owner, ident, _metadata(body.get("metadata")))
        items = api.input_items(body["items"], "items") if body.get("items") else []
        record.pending, calls, answered = api.chat_messages(items)
        if answered:
            raise invalid(
                f"no function_call with call_id {answered[0]!r} among the items before its output",
                param="items",
            )
        record.call_ids = sorted(calls)
        await self.bridge.run(self.records.create_conversation, ident, record, items)
        return JSONResponse(record.public(ident))

    async def conversation(self, request: Request, ident: str) -> StoredConversation:
        record = await self.bridge.run(self.records.conversation, ident, self.owner(request))
        if record is None:
            raise api.not_found("Conversation", ident, status=404)
        return record

    async def get_conversation(self, request: Request, ident: str) -> Response:
        return JSONResponse((await self.conversation(request, ident)).public(ident))

    async def update_conversation(self, request: Request, ident: str) -> Response:
        body = await self.read_body(request)
        if set(body) != {"metadata"}:
            raise invalid("a conversation's update takes 'metadata' only")
        record = await self.conversation(request, ident)
        record.metadata = _metadata(body["metadata"])
        await self.bridge.run(self.records.extend_conversation, ident, record, [])
        return JSONResponse(record.public(ident))

    async def delete_conversation(self, request: Request, ident: str) -> Response:
        record = await self.bridge.run(self.records.delete_conversation, ident, self.owner(request))
        if record is None:
            raise api.not_found("Conversation", ident, status=404)
        return JSONResponse({"id": ident, "object": "conversation.deleted", "deleted": True})

    async def conversation_items(self, request: Request, ident: str) -> Response:
        await self.conversation(request, ident)
        items = await self.bridge.run(self.records.conversation_items, ident)
        return JSONResponse(item_page(items, **_paging(request, default_order="desc")))


def _metadata(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()) or len(value) > 16:
        raise invalid("'metadata' is an object of at most 16 string values", param="metadata")
    return value


def _paging(request: Request, *, default_order: str) -> dict[str, Any]:
    query = request.query_params
    order = query.get("order", default_order)
    if order not in ("asc", "desc"):
        raise invalid("'order' is asc or desc", param="order")
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIST_LIMIT:
        raise invalid(f"'limit' is an integer from 1 to {MAX_LIST_LIMIT}", param="limit")
    return {"limit": limit, "order": order, "after": query.get("after")}


def add_routes(app: FastAPI, front: Front, read_body: BodyReader) -> None:
    """The Responses and Conversations routes, on the app's Redis (records are scoped to the tenant of
    the API key a request offers, when the server takes keys)."""
    routes = ResponsesAPI(front, Records(front.bridge.blocking), read_body)
    app.add_api_route("/v1/responses", routes.create, methods=["POST"])
    app.add_api_route("/v1/responses/{response_id}", routes.get, methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}", routes.delete, methods=["DELETE"])
    app.add_api_route("/v1/responses/{response_id}/input_items", routes.input_items, methods=["GET"])
    app.add_api_route("/v1/conversations", routes.create_conversation, methods=["POST"])
    app.add_api_route("/v1/conversations/{ident}", routes.get_conversation, methods=["GET"])
    app.add_api_route("/v1/conversations/{ident}", routes.update_conversation, methods=["POST"])
    app.add_api_route("/v1/conversations/{ident}", routes.delete_conversation, methods=["DELETE"])
    app.add_api_route("/v1/conversations/{ident}/items", routes.conversation_items, methods=["GET"])
