"""Errors as each API writes them: OpenAI's `{"error": {...}}` and Anthropic's `{"type": "error", ...}`."""

from __future__ import annotations

import json
import logging
import secrets
from typing import Any, Literal

from pydantic import ValidationError
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from producer.errors import JobCanceledError, JobFailedError
from producer.openai_shapes.bodies import validation_message
from producer.wire.protocol import ErrorCode

logger = logging.getLogger("kvrq.http")

Flavor = Literal["openai", "anthropic"]

#: status -> (OpenAI's error type, Anthropic's error type)
_TYPES: dict[int, tuple[str, str]] = {
    400: ("invalid_request_error", "invalid_request_error"),
    401: ("authentication_error", "authentication_error"),
    404: ("invalid_request_error", "not_found_error"),
    405: ("invalid_request_error", "invalid_request_error"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "rate_limit_error"),
    500: ("server_error", "api_error"),
    503: ("server_error", "overloaded_error"),
    504: ("timeout", "timeout_error"),
}

#: A failed job's status, by the ErrorCode its worker recorded (protocol.py); others: 500.
_STATUS_OF_JOB_ERROR = {
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: 400,
    ErrorCode.TIMEOUT: 504,
}


class APIError(Exception):
    """An HTTP error answered in the API's own JSON; `retry_after` (seconds) becomes a header."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}

    def body(self, flavor: Flavor) -> dict[str, Any]:
        openai_type, anthropic_type = _TYPES.get(self.status, _TYPES[400 if self.status < 500 else 500])
        if flavor == "anthropic":
            return {"type": "error", "error": {"type": anthropic_type, "message": self.message}}
        return {
            "error": {"message": self.message, "type": openai_type, "param": self.param, "code": self.code}
        }

    def sse(self, flavor: Flavor) -> bytes:
        """The error as the last event of a stream that had already begun (status 200 was sent)."""
        data = json.dumps(self.body(flavor), ensure_ascii=False)
        return (f"event: error\ndata: {data}\n\n" if flavor == "anthropic" else f"data: {data}\n\n").encode()


def flavor_of(path: str) -> Flavor:
    """Anthropic's routes answer in Anthropic's shape, every other route in OpenAI's."""
    return "anthropic" if path.startswith("/v1/messages") else "openai"


def invalid(message: str, *, param: str | None = None) -> APIError:
    return APIError(400, message, code="invalid_request", param=param)


def from_validation(exc: ValidationError) -> APIError:
    """400 with pydantic's reasons (where, what), as the producer's batch lines give them."""
    return invalid(validation_message(exc))


def from_job_failure(exc: JobFailedError) -> APIError:
    """A job that ended without a result: its worker's code decides the status."""
    if isinstance(exc, JobCanceledError):
        return APIError(500, f"job {exc.job_id} was canceled", code="job_canceled")
    status = _STATUS_OF_JOB_ERROR.get(exc.code, 500)
    return APIError(status, f"job {exc.job_id} failed: {exc.reason}", code=exc.code)


def new_request_id() -> str:
    """An id for a request that has no job id (the client quotes it, the log holds it)."""
    return f"req_{secrets.token_hex(12)}"


class ServerErrors:
    """ASGI middleware: an exception no handler took becomes a 500 in the API's shape, logged with a
    request id the client also gets (x-request-id, request-id, and in the message), and sent with
    `Connection: close`, so a keep-alive client opens a new connection for its next request instead
    of reusing one the server may no longer trust. Once a response has begun it can only be cut off.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as exc:
            if started:
                raise
            request_id = new_request_id()
            path = scope.get("path", "")
            logger.exception("%s %s failed, request id %s", scope.get("method"), path, request_id)
            error = APIError(500, f"internal error ({type(exc).__name__}), request id {request_id}")
            headers = {"x-request-id": request_id, "request-id": request_id, "connection": "close"}
            await JSONResponse(error.body(flavor_of(path)), 500, headers=headers)(scope, receive, send)
