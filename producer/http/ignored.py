"""Fields a request sent that kvrq accepts but does not act on, named back in `x-kvrq-ignored`.

Clients add fields to the APIs every month; a local server that refused them would be one agents
cannot use, and one that dropped them silently would hide what it does not do. So every field an
official API defines is accepted, and one that changes nothing here (client metadata, analytics ids,
betas whose edits are no-ops, hosted tools kvrq cannot run) is named: the parsers call `ignore(path)`
while they read a body, and the `IgnoredFields` middleware writes the paths into the response's
`x-kvrq-ignored` header (comma-separated, in the order first named) and logs them, for all three APIs.
"""

from __future__ import annotations

import logging
from contextvars import ContextVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger("kvrq.http")

HEADER = "x-kvrq-ignored"
#: The paths named so far by the request being handled (None outside a request: parsers used alone).
_named: ContextVar[list[str] | None] = ContextVar("kvrq_ignored", default=None)


def ignore(path: str) -> None:
    """Name a field path the request sent that kvrq accepts and does not act on."""
    named = _named.get()
    if named is not None and path not in named:
        named.append(path)


def collecting() -> list[str]:
    """Start naming for this context (a test, or a caller without the middleware); the list it fills."""
    named: list[str] = []
    _named.set(named)
    return named


class IgnoredFields:
    """ASGI middleware: the paths the handler named go out in HEADER and the log."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        named: list[str] = []
        token = _named.set(named)

        async def send_named(message: Message) -> None:
            if message["type"] == "http.response.start" and named:
                value = ",".join(named)
                message = {
                    **message,
                    "headers": [*message.get("headers", []), (HEADER.encode(), value.encode())],
                }
                logger.info(
                    "%s %s: accepted, not acted on: %s", scope.get("method"), scope.get("path"), value
                )
            await send(message)

        try:
            await self.app(scope, receive, send_named)
        finally:
            _named.reset(token)
