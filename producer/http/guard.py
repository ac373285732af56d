"""What a request must pass before its body is read: the size limit and, when keys are set, an API key.

Both are plain ASGI middleware, so a body over the limit is refused from its Content-Length header
(413) without reading it, and one sent without that header is cut off as soon as it passes the limit.
API keys come as `Authorization: Bearer KEY` (OpenAI) or `x-api-key: KEY` (Anthropic); each offered
key is compared with every configured one in constant time, and no key is ever logged. Each key is a
tenant's (producer/tenants.py): the one an operator named beside it in the key file, else one derived
from a digest of the key; the request carries its tenant on (`request_tenant`).
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from producer.http.errors import APIError, flavor_of
from producer.tenants import Tenant, key_tenant, tenant_problem

#: Paths open without a key (a load balancer's health check).
OPEN_PATHS = frozenset({"/health"})
API_KEYS_ENV = "KVRQ_API_KEYS"
#: Where ApiKeys leaves the tenant of the key a request offered, in the ASGI scope.
TENANT_SCOPE_KEY = "kvrq.tenant"


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
    """401 without a valid key; with one, its tenant goes into the scope (TENANT_SCOPE_KEY).

    `keys`: key -> the tenant an operator named (None: derived from the key, `key_tenant`)."""

    def __init__(self, app: ASGIApp, keys: Mapping[str, str | None]) -> None:
        self.app = app
        self.keys = [(key.encode(), Tenant(tenant or key_tenant(key))) for key, tenant in keys.items()]

    def tenant(self, scope: Scope) -> Tenant | None:
        """The tenant of the key the request offers; None when it offers no valid key."""
        offered = _header(scope, b"x-api-key")
        bearer = _header(scope, b"authorization")
        if bearer is not None and bearer[:7].lower() == "bearer ":
            offered = bearer[7:].strip()
        if offered is None:
            return None
        candidate = offered.encode()
        found = None
        for key, tenant in self.keys:  # every key compared, whichever matches
            if hmac.compare_digest(candidate, key):
                found = tenant
        return found

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path") not in OPEN_PATHS:
            tenant = self.tenant(scope)
            if tenant is None:
                error = APIError(401, "a valid API key is required (Authorization: Bearer KEY, or x-api-key)")
                await error_response(scope, error)(scope, receive, send)
                return
            scope[TENANT_SCOPE_KEY] = tenant
        await self.app(scope, receive, send)


def request_tenant(scope: Scope) -> Tenant | None:
    """The tenant of a request (None: the server takes no keys, one space for all)."""
    tenant = scope.get(TENANT_SCOPE_KEY)
    return tenant if isinstance(tenant, Tenant) else None


def load_keys(path: str | None, env: dict[str, str] | os._Environ[str] | None = None) -> list[str]:
    """The API keys of `load_key_tenants`, without their tenants."""
    return list(load_key_tenants(path, env))


def load_key_tenants(
    path: str | None, env: dict[str, str] | os._Environ[str] | None = None
) -> dict[str, str | None]:
    """API keys -> the tenant an operator named (None: derived from the key). The file `path` has one
    key per line, optionally followed by whitespace and its tenant (`KEY acme`: keys of one tenant share
    its agents, which is how a key is rotated); blank lines and # comments are skipped. KVRQ_API_KEYS
    adds bare keys (comma-separated). None of either: the server needs no key. ValueError names the
    line of a bad tenant or a key listed twice, never the key."""
    environ: Any = os.environ if env is None else env
    keys: dict[str, str | None] = {}

    def add(key: str, tenant: str | None, where: str) -> None:
        if key in keys:
            raise ValueError(f"{where}: this API key is listed twice")
        if tenant is not None and (problem := tenant_problem(tenant)) is not None:
            raise ValueError(f"{where}: {problem}")
        keys[key] = tenant

    for key in environ.get(API_KEYS_ENV, "").split(","):
        if key.strip():
            add(key.strip(), None, API_KEYS_ENV)
    if path is not None:
        for number, line in enumerate(Path(path).read_text().splitlines(), 1):
            parts = line.split()
            if not parts or parts[0].startswith("#"):
                continue
            if len(parts) > 2:
                raise ValueError(f"{path}:{number}: a line is KEY or KEY TENANT")
            add(parts[0], parts[1] if len(parts) == 2 else None, f"{path}:{number}")
    return keys


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None
