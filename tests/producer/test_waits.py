"""The clients' shared waits (producer/waits.py): the rule driven step by step with scripted answers and a
fake clock, and what both clients make of a stream's final event now that it carries the job's ending."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest

from producer import waits
from producer.errors import JobFailedError, ResultTimeoutError
from producer.models import Usage
from producer.outcome import carried_usage, seen
from producer.tenants import tenant_of
from producer.wire.protocol import ErrorCode, StreamEvent, stream_key
from tests.producer.fakes import fail_like_rq

USAGE = {"prompt_tokens": 9, "reused_tokens": 4, "prefilled_tokens": 5, "generated_tokens": 2}


def _entries(*events: StreamEvent) -> list[Any]:
    """An XREAD reply of one stream holding `events`."""
    fields = [
        (f"{n}-0".encode(), {k.encode(): v.encode() for k, v in e.to_fields().items()})
        for n, e in enumerate(events, 1)
    ]
    return [[b"kvrq:stream:j1", fields]]


def _raise(error: Exception) -> None:
    """An answer whose I/O raised `error` (the outcome of a failed job)."""
    raise error


def _steps(run: waits.Run[Any], answer: Callable[[waits.Step], Any], most: int = 50) -> list[waits.Step]:
    """Drives `run` to its end with `answer`, returning the steps it took."""
    taken: list[waits.Step] = []
    while run.step is not None and len(taken) < most:
        step = run.step
        taken.append(step)
        run.settle(partial(answer, step))
    assert run.step is None, taken
    return taken


@pytest.mark.parametrize(
    "end",
    [
        StreamEvent("end", finish_reason="stop", data={"usage": USAGE}),
        StreamEvent("end", finish_reason="stop"),
    ],
    ids=["with usage", "an older worker's"],
)
def test_a_streams_final_event_ends_the_events_wait_without_a_status_or_result_read(end: StreamEvent) -> None:
    delta = StreamEvent("delta", text="Hi", token=5)
    run = waits.Run(waits.events("j1", None, timeout=10))
    steps = _steps(run, lambda step: _entries(delta, end) if isinstance(step, waits.Read) else None)
    assert [type(step) for step in steps] == [waits.Read, waits.Emit, waits.Emit]
    assert [step.event for step in steps[1:]] == [delta, end]  # type: ignore[union-attr]


def test_an_end_events_usage_is_read_off_it_and_an_older_workers_end_has_none() -> None:
    carried = StreamEvent("end", finish_reason="length", data={"usage": USAGE})
    assert carried_usage(carried) == Usage.model_validate(USAGE)
    assert carried_usage(StreamEvent("end", finish_reason="stop")) is None  # an older worker's
    assert carried_usage(StreamEvent("end", finish_reason="canceled")) is None
    assert carried_usage(StreamEvent("end", finish_reason="stop", data={"usage": {"x": 1}})) is None


def test_an_error_event_with_its_code_is_the_failure_and_one_without_reads_rqs_record() -> None:
    coded = StreamEvent("error", error="prompt too long", code=ErrorCode.CONTEXT_LENGTH_EXCEEDED)
    run = waits.Run(waits.failure("j1", coded, wait_s=2.0))
    assert run.step is None  # nothing to read, nothing to wait for
    assert (run.value.code, run.value.reason) == (ErrorCode.CONTEXT_LENGTH_EXCEEDED, "prompt too long")  # type: ignore[union-attr]

    older = waits.Run(waits.failure("j1", StreamEvent("error", error="boom"), wait_s=2.0))
    assert isinstance(older.step, waits.Read)  # the rq result's stream first, as result() reads it
    older.settle(lambda: [])
    assert isinstance(older.step, waits.Outcome)
    older.settle(partial(_raise, JobFailedError("j1", "boom", code=ErrorCode.ENGINE_ERROR)))
    assert older.step is None and older.value is not None and older.value.code == ErrorCode.ENGINE_ERROR


def test_a_result_wait_reads_the_last_result_before_the_outcome_and_times_out_saying_where() -> None:
    now = [0.0]
    run = waits.Run(waits.result("j1", timeout=1.5, clock=lambda: now[0]))

    def answer(step: waits.Step) -> Any:
        if isinstance(step, waits.Read) and step.commands[0].name == "xread":
            assert step.commands[0].options["block"] == (1000 if now[0] == 0 else 500)
            now[0] += 1.0  # the blocking read waited its whole block
            return []
        return "queued, no worker listens" if isinstance(step, waits.Where) else None

    with pytest.raises(ResultTimeoutError, match="did not end within 1.5 s: queued, no worker listens"):
        _steps(run, answer)


def test_a_tenants_error_event_keeps_its_code() -> None:
    event = StreamEvent("error", error="agent 't:acme:a' is busy", code=ErrorCode.INVALID_REQUEST)
    assert seen(event, tenant_of("acme")) == StreamEvent(
        "error", error="agent 'a' is busy", code=ErrorCode.INVALID_REQUEST
    )


def test_a_stream_whose_error_carries_its_code_raises_it_at_once(producer: Any) -> None:
    """No rq record yet (the worker fails the rq job just after): the event's code, not a 2 s wait."""
    handle = producer.submit({"prompt": "a"})
    error = StreamEvent("error", error="prompt too long", code=ErrorCode.CONTEXT_LENGTH_EXCEEDED)
    producer.connection.xadd(stream_key(handle.id), error.to_fields())
    started = time.monotonic()
    with pytest.raises(JobFailedError) as failed:
        list(handle.stream(timeout=5))
    assert time.monotonic() - started < 1.0
    assert (failed.value.code, failed.value.reason) == (ErrorCode.CONTEXT_LENGTH_EXCEEDED, "prompt too long")


def test_a_stream_whose_error_has_no_code_takes_it_from_rq(producer: Any) -> None:
    handle = producer.submit({"prompt": "a"})
    producer.connection.xadd(stream_key(handle.id), StreamEvent("error", error="kaboom").to_fields())
    fail_like_rq(
        producer.connection, handle.id, "E: kaboom", {"code": ErrorCode.TIMEOUT, "message": "kaboom"}
    )
    with pytest.raises(JobFailedError) as failed:
        list(handle.stream(timeout=5))
    assert failed.value.code == ErrorCode.TIMEOUT and "E: kaboom" in failed.value.details
