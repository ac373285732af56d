"""How a job's wait ends without a result: the errors both clients (client.py, aio.py) raise."""

from __future__ import annotations

from producer.wire.protocol import ErrorCode


class JobFailedError(Exception):
    """The job ended without a result; `reason` is the worker's one-line reason.

    `code` says why in a form to decide on: an ErrorCode value (protocol.py) the worker recorded,
    ErrorCode.INTERNAL when it recorded none; "canceled" for JobCanceledError.
    """

    def __init__(
        self,
        job_id: str,
        reason: str,
        *,
        status: str = "failed",
        details: str | None = None,
        code: str = ErrorCode.INTERNAL,
    ) -> None:
        self.job_id = job_id
        self.reason = reason
        self.status = status
        self.details = details or reason
        self.code = code
        super().__init__(f"job {job_id} {status} ({code}): {reason}")


class JobCanceledError(JobFailedError):
    """The job was canceled before it finished."""

    def __init__(self, job_id: str) -> None:
        super().__init__(job_id, "canceled", status="canceled", code="canceled")


class JobNotFoundError(LookupError):
    """No such job in Redis (never enqueued, or its TTL ran out)."""


class ResultTimeoutError(TimeoutError):
    """The job did not end within the given timeout; it keeps running."""
