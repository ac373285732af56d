"""A streamed answer's ending read off the stream's final event (issue 41): the end event's usage and the
error event's code, with no wait for the rq result; an older worker's events (no usage, no code) still
take them from rq, with the same answer."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from producer.aio import AsyncJobHandle
from producer.client import Producer
from producer.http import pools
from producer.http.app import ServeSettings, create_app
from producer.http.bridge import Bridge
from producer.http.pools import Pool
from producer.models import GenerationRequest
from producer.openai_shapes.bodies import CHAT_URL
from producer.wire.protocol import ErrorCode, StreamEvent, stream_key
from tests.producer.fakes import app_connections, fail_like_rq, fake_redis, finish_like_rq

JOB = "job-1"
USAGE = {"prompt_tokens": 9, "reused_tokens": 4, "prefilled_tokens": 5, "generated_tokens": 2}
CHAT = {
    "model": "m",
    "messages": [{"role": "user", "content": "x"}],
    "stream": True,
    "stream_options": {"include_usage": True},
}
MESSAGES = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True, "max_tokens": 8}


@pytest.fixture
def redis(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """One served model; every request's job is JOB (an existing JOB is not enqueued again), whose stream a
    test writes as its worker would."""
    monkeypatch.setattr(pools, "served_pools", lambda connection: {"m": Pool("m", "kvrq", 1)})

    async def submit(self: Bridge, request: GenerationRequest) -> AsyncJobHandle:
        return await self.producer.submit(request, job_id=JOB)

    monkeypatch.setattr(Bridge, "submit", submit)
    yield fake_redis()


def _post(redis: Any, path: str, body: dict[str, Any], *events: StreamEvent) -> tuple[Any, float]:
    """The response to `body` of a job whose stream holds `events`, and the seconds it took."""
    for event in events:
        redis.xadd(stream_key(JOB), event.to_fields())
    with TestClient(create_app(ServeSettings(), **app_connections(redis))) as http:
        started = time.monotonic()
        response = http.post(path, json=body)
        return response, time.monotonic() - started


def _older_worker(redis: Any) -> Producer:
    """JOB enqueued before the request, so its rq record can be written first, as an older worker's."""
    producer = Producer(connection=redis)
    producer.submit({"prompt": "x"}, job_id=JOB)
    return producer


def _result() -> dict[str, Any]:
    return {
        "job_id": JOB,
        "agent_id": None,
        "text": "Hi",
        "token_ids": [5, 2],
        "finish_reason": "stop",
        "usage": USAGE,
        "timings": {"queued_s": 0.0, "time_to_first_token_s": 0.1, "total_s": 0.2},
    }


def _chat_usage(response: Any) -> dict[str, Any]:
    chunks = [
        line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: {")
    ]
    return dict(json.loads(chunks[-1])["usage"])


def _anthropic_usage(response: Any) -> dict[str, Any]:
    lines = response.text.splitlines()
    data = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    (delta,) = [event for event in data if event["type"] == "message_delta"]
    return dict(delta["usage"])


CHAT_USAGE = {
    "prompt_tokens": 9,
    "completion_tokens": 2,
    "total_tokens": 11,
    "prompt_tokens_details": {"cached_tokens": 4},
}
ANTHROPIC_USAGE = {
    "input_tokens": 5,
    "output_tokens": 2,
    "cache_creation_input_tokens": 0,
    "cache_read_input_tokens": 4,
}
CARRIED = StreamEvent("end", finish_reason="stop", data={"usage": USAGE})
OLDER = StreamEvent("end", finish_reason="stop")


@pytest.mark.parametrize("end", [CARRIED, OLDER], ids=["end event with usage", "an older worker's end"])
@pytest.mark.parametrize(
    ("path", "body", "usage_of", "expected"),
    [
        (CHAT_URL, CHAT, _chat_usage, CHAT_USAGE),
        ("/v1/messages", MESSAGES, _anthropic_usage, ANTHROPIC_USAGE),
    ],
    ids=["openai", "anthropic"],
)
def test_a_streams_usage_is_its_end_events_else_rqs_the_same(
    redis: Any, end: StreamEvent, path: str, body: dict[str, Any], usage_of: Any, expected: dict[str, Any]
) -> None:
    """With usage on the end event the job is never finished in rq: reading rq would wait 5 s and find
    no usage. An older worker's end has none: the usage is its rq result's, the same answer."""
    if end is OLDER:
        finish_like_rq(redis, _older_worker(redis).handle(JOB).id, _result())
    response, took = _post(redis, path, body, StreamEvent("delta", text="Hi", token=5), end)
    assert response.status_code == 200 and usage_of(response) == expected
    assert took < 3.0


@pytest.mark.parametrize("coded", [True, False], ids=["error event with code", "an older worker's error"])
def test_a_streams_error_is_answered_with_its_events_code_else_rqs_the_same(redis: Any, coded: bool) -> None:
    reason, code = "prompt too long", ErrorCode.CONTEXT_LENGTH_EXCEEDED
    if not coded:
        fail_like_rq(
            redis, _older_worker(redis).handle(JOB).id, f"E: {reason}", {"code": code, "message": reason}
        )
    response, took = _post(
        redis, CHAT_URL, CHAT, StreamEvent("error", error=reason, code=code if coded else None)
    )
    assert response.status_code == 400 and took < 3.0
    assert response.json()["error"]["code"] == code
    assert response.json()["error"]["message"] == f"job {JOB} failed: {reason}"
