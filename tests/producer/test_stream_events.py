"""The stream event wire format, field by field: what a worker writes and what any reader (of any
version) parses back, so a change to StreamEvent's encoding cannot pass unnoticed."""

from __future__ import annotations

import pytest

from producer.wire.protocol import StreamEvent

#: Each event and its exact Redis stream fields.
WIRE = [
    (StreamEvent("start", attempt="a1"), {"e": "start", "attempt": "a1"}),
    (StreamEvent("start"), {"e": "start", "attempt": ""}),
    (StreamEvent("delta", text="hé", token=7), {"e": "delta", "t": "hé", "tok": "7"}),
    (StreamEvent("delta", text=""), {"e": "delta", "t": "", "tok": "-1"}),
    (StreamEvent("reasoning", text="hmm"), {"e": "reasoning", "t": "hmm"}),
    (
        StreamEvent("tool_call", data={"id": "c1", "function": {"name": "f", "arguments": "{}"}}),
        {"e": "tool_call", "data": '{"id": "c1", "function": {"name": "f", "arguments": "{}"}}'},
    ),
    (StreamEvent("logprobs", data={"token": "é"}), {"e": "logprobs", "data": '{"token": "é"}'}),
    (StreamEvent("end", finish_reason="stop"), {"e": "end", "reason": "stop"}),
    (
        StreamEvent("end", finish_reason="length", data={"usage": {"total_tokens": 3}}),
        {"e": "end", "reason": "length", "data": '{"usage": {"total_tokens": 3}}'},
    ),
    (StreamEvent("error", error="boom"), {"e": "error", "error": "boom"}),
    (StreamEvent("error", error="boom", code="timeout"), {"e": "error", "error": "boom", "code": "timeout"}),
]


@pytest.mark.parametrize(("event", "fields"), WIRE, ids=[f"{e.kind}-{i}" for i, (e, _) in enumerate(WIRE)])
def test_each_event_writes_its_fields_and_reads_back_from_str_and_bytes(
    event: StreamEvent, fields: dict[str, str]
) -> None:
    assert event.to_fields() == fields
    assert StreamEvent.from_fields(fields) == event
    assert StreamEvent.from_fields({k.encode(): v.encode() for k, v in fields.items()}) == event


def test_fields_a_writer_left_out_read_as_their_defaults() -> None:
    assert StreamEvent.from_fields({"e": "delta"}) == StreamEvent("delta", text="", token=None)
    assert StreamEvent.from_fields({"e": "end", "reason": ""}) == StreamEvent("end")
    assert StreamEvent.from_fields({"e": "error", "code": ""}) == StreamEvent("error", error="")
    assert StreamEvent.from_fields({"e": "tool_call"}) == StreamEvent("tool_call", data={})


def test_an_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown stream event"):
        StreamEvent.from_fields({"e": "nonsense"})
