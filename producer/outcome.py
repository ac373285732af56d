"""What a job's Redis state means to a client: its result, its failure, its stream's end.

Both clients read the same keys (the blocking JobHandle in client.py, the asyncio one in aio.py) and
hand the replies to these functions, so a result, an error code or a replayed stream reads the same
whichever client waits. Nothing here does I/O.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

from pydantic import ValidationError
from rq.job import JobStatus
from rq.results import Result
from rq.serializers import resolve_serializer

from producer.errors import JobCanceledError, JobFailedError
from producer.models import GenerationResult, Usage
from producer.tenants import Tenant
from producer.wire.protocol import SERIALIZER, StreamEvent, failure_of
from producer.wire.text import as_text

TERMINAL_STATUSES = frozenset({JobStatus.FINISHED, JobStatus.FAILED, JobStatus.CANCELED, JobStatus.STOPPED})
#: Statuses whose job has an outcome to read (a canceled one has none: JobCanceledError).
ENDED_STATUSES = frozenset({JobStatus.FINISHED, JobStatus.FAILED, JobStatus.STOPPED})
_SERIALIZER = resolve_serializer(SERIALIZER)


def status_text(raw: Any) -> str | None:
    """rq's status field as a string (None: the job is not in Redis)."""
    return None if raw is None else as_text(raw)


def latest_result(job_id: str, reply: Any) -> Result | None:
    """The job's latest rq Result from an XREVRANGE of its results stream (count 1), as rq reads it."""
    if not reply:
        return None
    result_id, payload = reply[0]
    return Result.restore(job_id, as_text(result_id), payload, connection=None, serializer=_SERIALIZER)  # type: ignore[arg-type]


def failure(
    job_id: str, status: str, latest: Result | None, raw_meta: Any, tenant: Tenant | None
) -> JobFailedError:
    """The error of a failed (or stopped) job: the worker's structured error in job.meta when it wrote
    one, else what rq recorded (protocol.failure_of); a tenant's qualified ids unqualified."""
    code, reason, details = failure_parts(latest, raw_meta)
    if tenant is not None:
        reason, details = tenant.unqualified(reason), tenant.unqualified(details or reason)
    return JobFailedError(job_id, reason, status=status, details=details, code=code)


def failure_parts(latest: Result | None, raw_meta: Any) -> tuple[str, str, str | None]:
    """(code, one-line reason, rq's exc_string) of a failed job."""
    details = latest.exc_string if latest is not None else None
    if isinstance(raw_meta, str):
        raw_meta = raw_meta.encode()
    try:
        meta = _SERIALIZER.loads(raw_meta) if raw_meta else None
    except ValueError:  # meta written by a foreign client in another serializer: no kvrq error in it
        meta = None
    code, reason = failure_of(meta if isinstance(meta, dict) else None, details)
    return code, reason, details


def outcome(
    job_id: str, status: str, latest: Result | None, raw_meta: Any, tenant: Tenant | None
) -> GenerationResult | None:
    """The result of an ended job (None while it has not ended); raises its JobFailedError or
    JobCanceledError. `latest` and `raw_meta` matter only once status is in ENDED_STATUSES."""
    if status == JobStatus.CANCELED:
        raise JobCanceledError(job_id)
    if status not in ENDED_STATUSES:
        return None
    if status != JobStatus.FINISHED:
        raise failure(job_id, status, latest, raw_meta, tenant)
    if latest is None or latest.type != Result.Type.SUCCESSFUL:
        raise JobFailedError(job_id, "finished, but its result has expired", status="expired")
    result = GenerationResult.model_validate(latest.return_value)
    return result if tenant is None else tenant.result(result)


def seen(event: StreamEvent, tenant: Tenant | None) -> StreamEvent:
    """An event as the handle's tenant sees it (an error's text unqualified, its code kept)."""
    if tenant is None or event.kind != "error" or not event.error:
        return event
    return replace(event, error=tenant.unqualified(event.error))


def carried_usage(event: StreamEvent) -> Usage | None:
    """The usage a finished job's end event carries (its result's), or None: a canceled job's end, an
    older worker's (no data), or data that does not read as usage; then the rq result has it."""
    usage = (event.data or {}).get("usage") if event.kind == "end" else None
    try:
        return None if usage is None else Usage.model_validate(usage)
    except ValidationError:
        return None


def carried_failure(job_id: str, event: StreamEvent) -> JobFailedError | None:
    """The failure an error event carries whole: the worker's code (written for a job that failed for
    good, as in its job.meta) and its one-line reason; None for an event without a code (an older
    worker's, a stopped job's): then the rq job has it. `details` is the reason (rq's traceback is not
    on the stream)."""
    if event.kind != "error" or not event.code:
        return None
    return JobFailedError(job_id, event.error or "failed", code=event.code)


def needs_result(status: str, rest: list[StreamEvent]) -> bool:
    """Whether `closing_events` needs the job's result (or failure) to close its stream."""
    return not (rest and rest[-1].final) and status != JobStatus.CANCELED


def closing_events(
    status: str,
    rest: list[StreamEvent],
    ended: GenerationResult | JobFailedError | None,
    seen_any: bool,
) -> list[StreamEvent]:
    """The events that close the stream of an ended job whose end marker the reader has not seen.

    `rest`: what its stream still held (the worker writes the end marker before it ends the rq job);
    else a canceled job ends "canceled", a failed one with its error, a finished one with its result
    (rebuilt as events when the reader saw none: the stream expired before it came). `ended` is the
    job's result or failure where `needs_result`, else None.
    """
    if not needs_result(status, rest):
        return rest if rest and rest[-1].final else [StreamEvent("end", finish_reason="canceled")]
    if isinstance(ended, JobFailedError):
        return [StreamEvent("error", error=ended.reason)]
    assert ended is not None
    head = [] if seen_any else result_events(ended)
    return [*head, StreamEvent("end", finish_reason=ended.finish_reason)]


def result_events(result: GenerationResult) -> list[StreamEvent]:
    """A finished job's events rebuilt from its result, for a stream that expired before it was read."""
    events = [StreamEvent("reasoning", text=result.reasoning)] if result.reasoning else []
    events.append(StreamEvent("delta", text=result.text))
    events += [
        StreamEvent("tool_call", data=call.model_dump(mode="json")) for call in result.tool_calls or ()
    ]
    return events


class Replay:
    """Leaves out what a re-run repeats: a job started again after a worker crash or drain streams again
    from its start (`start` event); the text, calls and logprobs already passed on are skipped (exact for
    greedy or seeded requests). Both clients' `stream()` and `fresh_events()` read through one."""

    def __init__(self) -> None:
        self.sent: Counter[str] = Counter()
        self.attempt: Counter[str] = Counter()

    def fresh(self, event: StreamEvent) -> StreamEvent | None:
        kind = event.kind
        if kind == "start":
            self.attempt.clear()
            return None
        if kind in ("delta", "reasoning"):
            skip = max(0, self.sent[kind] - self.attempt[kind])
            self.attempt[kind] += len(event.text)
            if skip >= len(event.text):
                return None
            self.sent[kind] += len(event.text) - skip
            return replace(event, text=event.text[skip:]) if skip else event
        if kind in ("tool_call", "logprobs"):
            self.attempt[kind] += 1
            if self.attempt[kind] <= self.sent[kind]:
                return None
            self.sent[kind] += 1
        return event
