"""What a request must pass before its body is read: the size limit and, when keys are set, an API key.

Both are plain ASGI middleware, so a body over the limit is refused from its Content-Length header
(413) without reading it, and one sent without that header is cut off as soon as it passes the limit.
API keys come as `Authorization: Bearer KEY` (OpenAI) or `x-api-key: KEY` (Anthropic); each offered
key is compared with every configured one in constant time, and no key is ever logged.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from producer.http.errors import APIError, flavor_of

#: Paths open without a key (a load balancer's health check).
OPEN_PATHS = frozenset({"/health"})
API_KEYS_ENV = "KVRQ_API_KEYS"


def error_response(scope: Scope, error: APIError) -> JSONResponse:
    return JSONResponse(error.body(flavor_of(scope.get("path", ""))), error.status, headers=error.headers())


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def too_large(self, size: str) -> APIError:
        return APIError(
            413, f"the request body is {size} bytes, the limit is {self.max_bytes}", code="request_too_large"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _header(scope, b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await error_response(scope, self.too_large(length))(scope, receive, send)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise self.too_large(f"more than {self.max_bytes:,}")
            return message

        await self.app(scope, limited, send)


class ApiKeys:
    def __init__(self, app: ASGIApp, keys: Iterable[str]) -> None:
        self.app = app
        self.keys = [key.encode() for key in keys]

    def allows(self, scope: Scope) -> bool:
        offered = _header(scope, b"x-api-key")
        bearer = _header(scope, b"authorization")
        if bearer is not None and bearer[:7].lower() == "bearer ":
            offered = bearer[7:].strip()
        if offered is None:
            return False
        candidate = offered.encode()
        matches = [hmac.compare_digest(candidate, key) for key in self.keys]  # every key, whichever matches
        return any(matches)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path") not in OPEN_PATHS and not self.allows(scope):
            error = APIError(401, "a valid API key is required (Authorization: Bearer KEY, or x-api-key)")
            await error_response(scope, error)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def load_keys(path: str | None, env: dict[str, str] | os._Environ[str] | None = None) -> list[str]:
    """API keys: one per line of `path` (blank lines and # comments skipped), plus KVRQ_API_KEYS
    (comma-separated). None of either: the server needs no key."""
    environ: Any = os.environ if env is None else env
    keys = [key.strip() for key in environ.get(API_KEYS_ENV, "").split(",") if key.strip()]
    if path is not None:
        lines = Path(path).read_text().splitlines()
        keys += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    return keys


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None
