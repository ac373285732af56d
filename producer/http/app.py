"""The ASGI app of `kvrq serve`: routes, middleware and error handlers (create_app).

Every generation route does the same: parse the body in its API's shape into GenerationRequest fields
(400 with the reason), validate them (400), pick the pool serving the model (404 naming the served
ones, 503 with Retry-After while none is live), refuse when its queue is deeper than the limit (429),
enqueue, then answer from the job's result or stream its events. A client that goes away, or a request
that outlives the request timeout (504), cancels its job.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from pydantic import ValidationError
from redis import Redis
from redis.asyncio import Redis as AsyncRedis
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response
from starlette.routing import Match, Route

from producer.aio import AsyncJobHandle, AsyncProducer
from producer.errors import JobNotFoundError
from producer.http import anthropic_api, conversations_routes, openai_api, openapi
from producer.http.body import parsed_body
from producer.http.bridge import Bridge, ClientGone, disconnected
from producer.http.errors import APIError, ServerErrors, flavor_of, from_validation, invalid
from producer.http.guard import ApiKeys, BodyLimit, request_tenant
from producer.http.ignored import IgnoredFields
from producer.http.model_cards import (
    CLAMP_HEADER,
    anthropic_model,
    clamp_of,
    clamped_to,
    openai_model,
    progress_prompt_tokens,
)
from producer.http.pools import RETRY_AFTER_S, Pool, PoolDirectory
from producer.http.sse import OnResult, Translator, open_stream
from producer.models import GenerationRequest, GenerationResult
from producer.openai_shapes.bodies import CHAT_URL, COMPLETIONS_URL
from producer.wire.redis_url import DEFAULT_REDIS_URL, connect
from producer.wire.redis_url_aio import connect_async

logger = logging.getLogger("kvrq.http")

AGENT_HEADER = "x-kvrq-agent"
STRICT_MAX_TOKENS_ENV = "KVRQ_STRICT_MAX_TOKENS"
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_REQUEST_TIMEOUT_S = 600.0
#: Waits on jobs the server keeps open at once (each holds a Redis connection while it blocks, about a
#: second at a time); a request beyond them waits for a connection to come free.
DEFAULT_MAX_WAITS = 512


@dataclass(frozen=True)
class ServeSettings:
    redis_url: str = DEFAULT_REDIS_URL
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    #: 429 when the model's queue already holds this many jobs (None: no limit).
    max_queued: int | None = None
    api_keys: tuple[str, ...] = ()
    #: (key, tenant) for the keys an operator named a tenant for; any other key is a tenant of its own.
    key_tenants: tuple[tuple[str, str], ...] = ()
    max_waits: int = DEFAULT_MAX_WAITS
    #: Cut a max_tokens beyond what the context leaves to what it leaves (clients send 32,000 to a
    #: local model's 8K context); False (KVRQ_STRICT_MAX_TOKENS=1) answers those 400 instead.
    fit_max_tokens: bool = field(default_factory=lambda: os.environ.get(STRICT_MAX_TOKENS_ENV) != "1")


def create_app(
    settings: ServeSettings, *, connection: Redis | None = None, aio_connection: AsyncRedis | None = None
) -> FastAPI:
    """`connection` (blocking: the pools' and records' rq reads, cancels) and `aio_connection` (every
    submit and wait) are both given, or both made from settings.redis_url."""
    if (connection is None) != (aio_connection is None):
        raise ValueError("give both connection and aio_connection, or neither")
    if connection is None or aio_connection is None:
        connection = connect(settings.redis_url)
        aio_connection = connect_async(
            settings.redis_url, wait_for_connection=True, max_connections=settings.max_waits
        )
    bridge = Bridge(AsyncProducer(connection=aio_connection, blocking=connection), connection)
    directory = PoolDirectory(connection)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await bridge.close()

    app = FastAPI(title="kvrq", lifespan=lifespan, docs_url=None, redoc_url=None)  # /openapi.json
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(IgnoredFields)
    if settings.api_keys:
        named = dict(settings.key_tenants)
        app.add_middleware(ApiKeys, keys={key: named.get(key) for key in settings.api_keys})
    _add_error_handlers(app)
    front = _Front(settings, bridge, directory)

    @app.get("/health")
    async def health() -> Response:
        try:
            pools = await bridge.run(directory.pools)
        except RedisError as exc:
            return JSONResponse({"status": "unavailable", "reason": f"Redis: {exc}"}, 503)
        return JSONResponse({"status": "ok", "models": sorted(pools)})

    @app.api_route("/", methods=["GET", "HEAD"])
    async def root() -> Response:
        """Clients probe the base URL before their first request (Claude Code: HEAD /)."""
        return JSONResponse({"service": "kvrq"})

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        pools = await bridge.run(directory.pools)
        if "anthropic-version" in request.headers:
            data = [anthropic_model(pool) for pool in pools.values()]
            first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
            return JSONResponse({"data": data, "has_more": False, "first_id": first, "last_id": last})
        return JSONResponse({"object": "list", "data": [openai_model(pool) for pool in pools.values()]})

    @app.post(CHAT_URL)
    async def chat(request: Request) -> Response:
        return await front.openai(request, CHAT_URL)

    @app.post(COMPLETIONS_URL)
    async def completions(request: Request) -> Response:
        return await front.openai(request, COMPLETIONS_URL)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await front.anthropic(request)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        return await front.count_tokens(request)

    conversations_routes.add_routes(app, front, _body)
    openapi.install(app)
    return app


class _Front:
    """What the generation routes share: body, validation, pool, enqueue, wait or stream."""

    def __init__(self, settings: ServeSettings, bridge: Bridge, directory: PoolDirectory) -> None:
        self.settings = settings
        self.bridge = bridge
        self.directory = directory

    async def openai(self, request: Request, url: str) -> Response:
        parsed = openai_api.parse(url, await _body(request), agent=request.headers.get(AGENT_HEADER))
        pool, handle = await self.submit(request, parsed.model, parsed.fields)
        translator = openai_api.stream_translator(parsed, handle.id, pool.model) if parsed.stream else None
        return await self.answer(
            request,
            handle,
            translator,
            lambda r: openai_api.response(parsed, pool.model, r),
            clamp=(pool, parsed.fields.get("max_tokens")),
        )

    async def anthropic(self, request: Request) -> Response:
        parsed = anthropic_api.parse(
            await _body(request), agent=request.headers.get(AGENT_HEADER), headers=request.headers
        )
        pool, handle = await self.submit(request, parsed.model, parsed.fields)
        translator = anthropic_api.MessageStream(handle.id, pool.model) if parsed.stream else None
        return await self.answer(
            request,
            handle,
            translator,
            lambda r: anthropic_api.response(pool.model, r),
            clamp=(pool, parsed.fields.get("max_tokens")),
        )

    async def count_tokens(self, request: Request) -> Response:
        """The tokenizer and chat template live in the worker: the count is a one-off job of one token
        (the prompt rendered and prefilled as a real request would be; no agent's cache is touched)."""
        parsed = anthropic_api.parse(await _body(request), count=True, headers=request.headers)
        fields = {
            **parsed.fields,
            "max_tokens": 1,
            "temperature": 0.0,
            "metadata": {"kvrq_http": "count_tokens"},
        }
        for name in ("agent_id", "continue", "fork_from"):  # counting reads no agent's memory
            fields.pop(name, None)
        _, handle = await self.submit(request, parsed.model, fields)
        return await self.answer(request, handle, None, lambda r: {"input_tokens": r.usage.prompt_tokens})

    async def answer(
        self,
        request: Request,
        handle: AsyncJobHandle,
        translator: Translator | None,
        body: Callable[[GenerationResult], dict[str, Any]],
        on_result: OnResult | None = None,
        clamp: tuple[Pool, int | None] | None = None,
    ) -> Response:
        """The job's stream through `translator`, or (None) its result as `body` makes it; the job id
        as the request id (OpenAI's x-request-id, Anthropic's request-id). 499 when the client left.
        `on_result` is awaited with the result first (a stream's: after its end event). `clamp` (the pool,
        the max_tokens asked for): an answer whose max_tokens the context cut says so in a header (a
        stream's from the prompt length the worker published by its first token)."""
        headers = {"x-request-id": handle.id, "request-id": handle.id}

        async def clamp_header() -> dict[str, str]:
            if clamp is None or clamp[1] is None:
                return {}
            try:
                meta = await handle.meta()
            except (JobNotFoundError, RedisError, ValueError):  # no header rather than no stream
                return {}
            ran_with = clamp_of(*clamp, progress_prompt_tokens(meta))
            return {} if ran_with is None else {CLAMP_HEADER: str(ran_with)}

        try:
            if translator is not None:
                return await open_stream(
                    self.bridge,
                    handle,
                    translator,
                    timeout=self.settings.request_timeout_s,
                    gone=disconnected(request.receive),
                    headers=headers,
                    on_result=on_result,
                    open_headers=clamp_header,
                )
            result = await self.bridge.result(
                handle, timeout=self.settings.request_timeout_s, gone=disconnected(request.receive)
            )
            if on_result is not None:
                await on_result(result)
        except ClientGone:
            logger.info("job %s: the client went away; job canceled", handle.id)
            return Response(status_code=499)
        if clamp is not None and (ran_with := clamped_to(*clamp, result)) is not None:
            headers[CLAMP_HEADER] = str(ran_with)
        return JSONResponse(body(result), headers=headers)

    async def submit(
        self, request: Request, model: str | None, fields: dict[str, Any]
    ) -> tuple[Pool, AsyncJobHandle]:
        try:
            generation = GenerationRequest.model_validate(
                {**fields, "max_tokens_fit": self.settings.fit_max_tokens}
            )
        except ValidationError as exc:
            raise from_validation(exc) from None
        # Under API keys, the one place every route's job becomes its tenant's (producer/tenants.py).
        tenant = request_tenant(request.scope)
        if tenant is not None:
            try:
                generation = tenant.request(generation)
            except ValueError as exc:
                raise invalid(str(exc)) from None
        pool = await self.bridge.run(self.directory.resolve, model)
        generation = generation.model_copy(update={"queue": pool.queue})
        if self.settings.max_queued is not None:
            depth = await self.bridge.producer.queue_length(pool.queue)
            if depth >= self.settings.max_queued:
                raise APIError(
                    429,
                    f"queue {pool.queue!r} holds {depth} jobs, the limit is {self.settings.max_queued}",
                    code="queue_full",
                    retry_after=RETRY_AFTER_S,
                )
        handle = await self.bridge.submit(generation)
        handle.tenant = tenant  # what the client reads back shows its own agent ids
        logger.info(
            "job %s: %s %s, model %s, queue %s, agent %s",
            handle.id,
            request.method,
            request.url.path,
            pool.model,
            pool.queue,
            generation.agent_id or "-",
        )
        return pool, handle


async def _body(request: Request) -> dict[str, Any]:
    return parsed_body(await request.body(), request.url.path)


def _methods(app: FastAPI, request: Request) -> list[str]:
    methods: set[str] = set()
    for route in app.routes:
        if isinstance(route, Route) and route.matches(request.scope)[0] != Match.NONE:
            methods |= route.methods or set()
    return sorted(methods)


def _add_error_handlers(app: FastAPI) -> None:
    def answer(request: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body(flavor_of(request.url.path)), error.status, headers=error.headers())

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return answer(request, exc)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        response = answer(
            request, APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
        )
        response.headers.update(exc.headers or {})
        if exc.status_code == 405:  # Allow: every route's methods on this path (Starlette names one's)
            response.headers["allow"] = ", ".join(_methods(app, request))
        return response

    @app.exception_handler(RedisError)
    async def redis_error(request: Request, exc: RedisError) -> JSONResponse:
        logger.warning("%s %s: Redis: %s", request.method, request.url.path, exc)
        return answer(request, APIError(503, f"Redis is unreachable: {exc}", retry_after=RETRY_AFTER_S))

    app.add_middleware(ServerErrors)  # any other exception: a 500 with a request id, then close
