"""A recording reverse proxy between a client under test and `kvrq serve`.

Clients talk to kvrq through it so a test can say what each one sent (method, path, the JSON body's
fields) and what it got back (status, kvrq's `x-kvrq-*` headers, the error body of a non-2xx), and
count the requests: a client looping on an error shows as a count. Responses stream through
unchanged (SSE events reach the client as kvrq sends them).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from tests.conftest import free_port
from tests.worker.procs import wait_for

#: Hop-by-hop headers, and those httpx recomputes from the body it forwards.
_DROPPED = frozenset({"host", "content-length", "transfer-encoding", "connection", "accept-encoding"})


@dataclass
class Exchange:
    """One request as the client sent it and the answer's status as kvrq gave it."""

    method: str
    path: str
    body: dict[str, Any] | None
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    error: str = ""  # the response body of a non-2xx answer
    sent_at: float = 0.0  # time.monotonic() when the request reached the proxy
    #: a 2xx answer's chunks as relayed, each with its time.monotonic(): the benchmark's first-token time
    received: list[tuple[float, bytes]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def brief(self) -> str:
        return f"{self.method} {self.path} -> {self.status} {self.error[:400]}".strip()


class RecordingProxy:
    """Forwards everything to `upstream`, keeping an `Exchange` per request, on a loopback port."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.port = free_port()
        self.exchanges: list[Exchange] = []
        self._client = httpx.AsyncClient(base_url=upstream, timeout=httpx.Timeout(900.0, connect=10.0))
        app = Starlette(routes=[Route("/{path:path}", self._forward, methods=_METHODS)])
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            lifespan="off",
            timeout_graceful_shutdown=2,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="recording-proxy", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> RecordingProxy:
        self._thread.start()
        wait_for(lambda: self._server.started, 10, "the recording proxy did not start")
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)

    def mark(self) -> int:
        """Where a session starts: `since(mark)` gives what it sent."""
        return len(self.exchanges)

    def since(self, mark: int) -> list[Exchange]:
        return self.exchanges[mark:]

    async def _forward(self, request: Request) -> Response:
        raw = await request.body()
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        exchange = Exchange(request.method, target, _json_object(raw), sent_at=time.monotonic())
        self.exchanges.append(exchange)
        # identity: the bytes relayed are the bytes kvrq wrote, and an error body reads as text
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROPPED}
        headers["accept-encoding"] = "identity"
        upstream = self._client.build_request(request.method, target, headers=headers, content=raw)
        try:
            answer = await self._client.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            exchange.status, exchange.error = 502, f"proxy: {exc!r}"
            return Response(exchange.error, status_code=502)
        exchange.status = answer.status_code
        exchange.headers = {k: v for k, v in answer.headers.items() if k.lower().startswith("x-kvrq")}
        passed = {k: v for k, v in answer.headers.items() if k.lower() not in _DROPPED}
        if not exchange.ok:
            body = await answer.aread()
            await answer.aclose()
            exchange.error = body.decode(errors="replace")
            return Response(body, status_code=answer.status_code, headers=passed)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in answer.aiter_raw():
                    exchange.received.append((time.monotonic(), chunk))
                    yield chunk
            finally:
                await answer.aclose()

        return StreamingResponse(relay(), status_code=answer.status_code, headers=passed)


_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


def _json_object(raw: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(raw) if raw else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
