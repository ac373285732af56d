"""The wire contract between producers and workers: names, Redis keys and stream events.

Both sides import this module (the worker depends on the producer, never the reverse), so
a key or field renamed here changes for both at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: The function path rq records for every kvrq job. Plain rq users enqueue this string.
JOB_FUNCTION = "worker.jobs.generate"
DEFAULT_QUEUE = "kvrq"
#: rq serializer alias used for every kvrq job: JSON, never pickle.
SERIALIZER = "json"

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
#: Field kvrq adds to its rq worker hash: jobs the worker holds at once (batch runs size their
#: concurrency from it).
CAPACITY_FIELD = "kvrq_capacity"
#: job.meta key of a failed job's structured error: {"code": ErrorCode value, "message": one line}.
#: Clients and batch runs decide on `code`, never on the text of rq's exc_info.
ERROR_META_KEY = "kvrq_error"


class ErrorCode:
    """Why a kvrq job failed; the values are the wire format (job.meta[ERROR_META_KEY]["code"])."""

    INVALID_REQUEST = "invalid_request"  # the payload can never run (bad fields, too large): not retried
    TIMEOUT = "timeout"  # the job ran past its job_timeout
    ENGINE_ERROR = "engine_error"  # the model step or the engine failed while the job ran
    WORKER_CRASHED = "worker_crashed"  # its workers died while holding it, past its crash budget
    INTERNAL = "internal"  # anything else the worker did not expect

    ALL = (INVALID_REQUEST, TIMEOUT, ENGINE_ERROR, WORKER_CRASHED, INTERNAL)


_PREFIX = "kvrq"


def stream_key(job_id: str) -> str:
    """Redis stream carrying one job's token deltas and its end marker."""
    return f"{_PREFIX}:stream:{job_id}"


def cancel_key(job_id: str) -> str:
    """Flag set by a producer to cancel a job the worker may already hold."""
    return f"{_PREFIX}:cancel:{job_id}"


def agent_lock_key(agent_id: str) -> str:
    """Lock that keeps two jobs of one agent from running at once, across workers."""
    return f"{_PREFIX}:agent-lock:{agent_id}"


CANCEL_FLAG_TTL_S = 24 * 3600

EventKind = Literal["start", "delta", "end", "error"]


@dataclass(frozen=True)
class StreamEvent:
    """One entry of a job's stream.

    `start`: a worker began (or, after a crash or drain, began again) an `attempt` of the job;
    `delta`: `text` (empty while a character is incomplete, and for the stop token) and `token`;
    `end`: `finish_reason` ("stop", "length" or "canceled"); `error`: `error` (the reason).
    """

    kind: EventKind
    text: str = ""
    token: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    attempt: str | None = None

    def to_fields(self) -> dict[str, str]:
        if self.kind == "start":
            return {"e": "start", "attempt": self.attempt or ""}
        if self.kind == "delta":
            return {"e": "delta", "t": self.text, "tok": str(self.token if self.token is not None else -1)}
        if self.kind == "end":
            return {"e": "end", "reason": self.finish_reason or ""}
        return {"e": "error", "error": self.error or ""}

    @classmethod
    def from_fields(cls, fields: dict[bytes, bytes] | dict[str, str]) -> StreamEvent:
        data = {_text(k): _text(v) for k, v in fields.items()}
        kind = data.get("e")
        if kind == "start":
            return cls("start", attempt=data.get("attempt") or None)
        if kind == "delta":
            token = int(data.get("tok", "-1"))
            return cls("delta", text=data.get("t", ""), token=None if token < 0 else token)
        if kind == "end":
            return cls("end", finish_reason=data.get("reason") or None)
        if kind == "error":
            return cls("error", error=data.get("error", ""))
        raise ValueError(f"unknown stream event {data!r}")

    @property
    def final(self) -> bool:
        return self.kind in ("end", "error")


def _text(value: bytes | str) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else value
