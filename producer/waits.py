"""The waits both clients run, written once: a job's result, its stream's events, a failed stream's error.

A wait holds the rule (its deadline, the order of its reads, what a stream's final event means, when the
rq result is read) and does no I/O: it is a generator that yields steps (a Redis read, the job's outcome,
a notice, where a late job stands, an event to pass on) and is sent each step's answer, or has the error
the step's I/O raised thrown in where it yielded. JobHandle (client.py) answers the steps blocking,
AsyncJobHandle (aio.py) awaited, so the two clients cannot wait differently.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Generator, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeAlias, TypeVar

from rq.job import Job
from rq.results import Result

from producer import outcome
from producer.errors import JobFailedError, JobNotFoundError, ResultTimeoutError
from producer.models import GenerationResult
from producer.outcome import TERMINAL_STATUSES
from producer.tenants import Tenant
from producer.wire.protocol import StreamEvent, stream_key

#: Seconds between a wait's looks at the job's status (a result or an event wakes it at once).
POLL_S = 1.0
#: Seconds a failed stream whose error event carries no code (an older worker's, a stopped job's) waits
#: for the job's recorded error: the worker writes the stream's error just before rq marks the job failed.
STREAM_FAILURE_WAIT_S = 2.0

T = TypeVar("T")
Clock = Callable[[], float]


@dataclass(frozen=True)
class Command:
    """One Redis command: the name of its method on a client or pipeline, and its arguments."""

    name: str
    args: tuple[Any, ...] = ()
    options: Mapping[str, Any] = field(default_factory=dict)

    def on(self, target: Any) -> Any:
        return getattr(target, self.name)(*self.args, **self.options)


@dataclass(frozen=True)
class Read:
    """Commands sent in one round trip (a pipeline without MULTI where there are several) and sent again
    while Redis is away (failover); answered with the reply, or the list of replies."""

    commands: tuple[Command, ...]

    def queue(self, pipe: Any) -> Any:
        for command in self.commands:
            command.on(pipe)
        return pipe


@dataclass(frozen=True)
class Outcome:
    """The job's result once it has ended, None before (the client's `_outcome`, which raises its failure)."""


@dataclass(frozen=True)
class Notice:
    """About every POLL_S of waiting: the client calls its `on_wait`."""


@dataclass(frozen=True)
class Where:
    """The wait ran out of time: answered with a line that says where the job stands (liveness.py)."""


@dataclass(frozen=True)
class Emit:
    """An event to pass on to the reader (an `events` wait's)."""

    event: StreamEvent


Step: TypeAlias = Read | Outcome | Notice | Where | Emit
Wait: TypeAlias = Generator[Step, Any, T]


class Run(Generic[T]):
    """A wait being driven: `step` is what it waits for next, None once it has returned its `value`.
    The driver settles each step with its answer, or with the error its I/O raised (raised in the wait)."""

    def __init__(self, wait: Wait[T]) -> None:
        self._wait = wait
        self._value: T | None = None
        self.step: Step | None = self._resume(wait.send, None)

    def settle(self, answer: Callable[[], Any]) -> None:
        try:
            reply = answer()
        except Exception as exc:
            self.step = self._resume(self._wait.throw, exc)
        else:
            self.step = self._resume(self._wait.send, reply)

    async def settle_async(self, answer: Awaitable[Any]) -> None:
        try:
            reply = await answer
        except Exception as exc:
            self.step = self._resume(self._wait.throw, exc)
        else:
            self.step = self._resume(self._wait.send, reply)

    def _resume(self, resume: Callable[[Any], Step], arg: Any) -> Step | None:
        try:
            return resume(arg)
        except StopIteration as done:
            self._value = done.value
            return None

    @property
    def value(self) -> T:
        assert self.step is None, "the wait has not ended"
        return self._value  # type: ignore[return-value]  # T itself may be None (an events wait)


def quiet() -> None:
    """An `on_wait` that does nothing (no notice)."""


def read(name: str, *args: Any, **options: Any) -> Read:
    """A Read of one command."""
    return Read((Command(name, args, options),))


def _xread(key: str, last_id: bytes | str, block: float | None, count: int) -> Read:
    """Entries of one stream after `last_id`, waiting up to `block` seconds for the first (None: not)."""
    block_ms = None if block is None else max(1, int(block * 1000))
    return read("xread", {key: last_id}, block=block_ms, count=count)


def _entries(reply: Any) -> list[tuple[bytes, dict[bytes, bytes]]]:
    return list(reply[0][1]) if reply else []


def _left(deadline: float | None, clock: Clock) -> float:
    """Seconds the next blocking read may wait: POLL_S, or less where the deadline is nearer."""
    return POLL_S if deadline is None else min(POLL_S, deadline - clock())


def _late(job_id: str, timeout: float | None) -> Wait[ResultTimeoutError]:
    where = yield Where()
    return ResultTimeoutError(f"job {job_id} did not end within {timeout} s: {where}")


def status(job_id: str) -> Wait[str]:
    """rq's status string of the job; JobNotFoundError when it is not in Redis."""
    found = outcome.status_text((yield read("hget", Job.key_for(job_id), "status")))
    if found is None:
        raise JobNotFoundError(f"no job {job_id} in Redis")
    return found


def ended(job_id: str, tenant: Tenant | None) -> Wait[GenerationResult | None]:
    """The result once the job has ended (None before); raises its failure (outcome.outcome)."""
    found = yield from status(job_id)
    latest, meta = None, None
    if found in outcome.ENDED_STATUSES:
        results = Command("xrevrange", (Result.get_key(job_id), "+", "-"), {"count": 1})
        reply, meta = yield Read((results, Command("hget", (Job.key_for(job_id), "meta"))))
        latest = outcome.latest_result(job_id, reply)
    return outcome.outcome(job_id, found, latest, meta, tenant)


def result(
    job_id: str, timeout: float | None, *, notices: bool = True, clock: Clock = time.monotonic
) -> Wait[GenerationResult]:
    """Until the job ends: its result, or its JobFailedError / JobCanceledError; ResultTimeoutError when
    `timeout` seconds pass first. `notices`: a Notice about every POLL_S of waiting."""
    deadline = None if timeout is None else clock() + timeout
    results_key = Result.get_key(job_id)
    while True:
        # The results stream's last entry is read before the status: a result written after the
        # status read lies past it and wakes the wait below at once (read after the status, the
        # wait could take that very result for an old one and sleep a whole poll).
        latest = yield read("xrevrange", results_key, "+", "-", count=1)
        last_id = latest[0][0] if latest else "0-0"
        found = yield Outcome()
        if found is not None:
            return found
        block = _left(deadline, clock)
        if block <= 0:
            raise (yield from _late(job_id, timeout))
        if notices:
            yield Notice()
        # Woken as soon as the worker writes a result; the poll catches cancels (no result).
        yield _xread(results_key, last_id, block, count=1)


def events(
    job_id: str, tenant: Tenant | None, timeout: float | None, *, clock: Clock = time.monotonic
) -> Wait[None]:
    """Every event of the job's stream, from the start, emitted up to its final (end or error) event;
    for a stream that will never get one, the events that close it (`_closing`)."""
    deadline = None if timeout is None else clock() + timeout
    key = stream_key(job_id)
    last_id: bytes | str = "0-0"
    seen_any = False
    while True:
        block = _left(deadline, clock)
        if block <= 0:
            raise (yield from _late(job_id, timeout))
        entries = _entries((yield _xread(key, last_id, block, count=1024)))
        if entries:
            for entry_id, fields in entries:
                last_id = entry_id
                seen_any = True
                event = outcome.seen(StreamEvent.from_fields(fields), tenant)
                yield Emit(event)
                if event.final:
                    return
            continue
        closing = yield from _closing(job_id, tenant, key, last_id, seen_any)
        if closing is not None:
            for event in closing:
                yield Emit(event)
            return
        yield Notice()


def _closing(
    job_id: str, tenant: Tenant | None, key: str, last_id: bytes | str, seen_any: bool
) -> Wait[list[StreamEvent] | None]:
    """Events that close a stream that will never get its end marker, or None to keep waiting.

    A job canceled in the queue, or failed before a worker took it, never had a stream;
    a stream may also have expired before a late reader came.
    """
    try:
        found = yield from status(job_id)
    except JobNotFoundError:
        return [StreamEvent("error", error=f"no job {job_id} in Redis")]
    if found not in TERMINAL_STATUSES:
        return None
    rest = [
        outcome.seen(StreamEvent.from_fields(fields), tenant)
        for _, fields in _entries((yield _xread(key, last_id, None, count=100_000)))
    ]
    closed: GenerationResult | JobFailedError | None = None
    if outcome.needs_result(found, rest):
        try:
            closed = yield from result(job_id, 0.001, notices=False)
        except JobFailedError as exc:
            closed = exc
    return outcome.closing_events(found, rest, closed, seen_any)


def failure(job_id: str, event: StreamEvent, wait_s: float) -> Wait[JobFailedError | None]:
    """The failure of a job whose stream ended with the error `event`: the one the event carries (its
    worker's code), else (an older worker's event, a stopped job's) the one rq records, waited for up to
    `wait_s`; None where none comes."""
    carried = outcome.carried_failure(job_id, event)
    if carried is not None:
        return carried
    try:
        yield from result(job_id, wait_s, notices=False)
    except JobFailedError as exc:
        return exc
    except (ResultTimeoutError, JobNotFoundError):
        pass
    return None
