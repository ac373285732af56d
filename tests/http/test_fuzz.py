"""1,000 fuzzed bodies through `kvrq serve`'s app: each is answered 4xx with a reason, or, when the
mutation left it valid, 200 (the job side is a stand-in here); never 5xx, and the app keeps serving."""

from __future__ import annotations

import copy
import json
import random
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from producer.aio import AsyncJobHandle
from producer.http import pools
from producer.http.app import ServeSettings, create_app
from producer.http.bridge import Bridge
from producer.http.pools import Pool
from producer.models import GenerationRequest, GenerationResult
from producer.wire.protocol import StreamEvent
from tests.batch.test_format import RESULT
from tests.producer.fakes import app_connections

SEEDS = 1000
MODEL = "smollm2-135m"
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
VALID: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        ],
        "max_tokens": 4,
        "temperature": 0.5,
        "stop": ["x"],
        "logprobs": True,
        "top_logprobs": 1,
        "tools": [TOOL],
        "tool_choice": "auto",
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "n", "schema": {"type": "object"}},
        },
        "stream": False,
        "prompt_cache_key": "agent-1",
    },
    "/v1/completions": {"model": MODEL, "prompt": "Once", "max_tokens": 4, "logprobs": 1, "stream": False},
    "/v1/messages": {
        "model": MODEL,
        "max_tokens": 4,
        "system": [{"type": "text", "text": "s"}],
        "messages": [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "c", "name": "f", "input": {"a": 1}}],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c", "content": "ok"}]},
        ],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any"},
        "stop_sequences": ["x"],
        "metadata": {"user_id": "agent-2"},
        "stream": False,
    },
    "/v1/messages/count_tokens": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
}
JUNK: list[Any] = [
    None, True, 0, -1, 2**70, 1.5, float("nan"), "", "x", "\u0000\ud800", [], [None], [1, "a"], {},
    {"type": "text"}, {"a": {"b": []}}, [{"type": "image", "source": {}}], {"$schema": 5},
    {"type": "object", "properties": 3},
]  # fmt: skip


def junk(rng: random.Random) -> Any:
    return copy.deepcopy(rng.choice(JUNK))


def mutate(value: Any, rng: random.Random, depth: int = 0) -> Any:
    """`value` with one random change somewhere inside: replaced, dropped, or an unknown key added."""
    if depth > 0 and rng.random() < 0.3 or not isinstance(value, dict | list) or not value:
        return junk(rng)
    value = copy.copy(value)
    if isinstance(value, list):
        index = rng.randrange(len(value))
        value[index] = mutate(value[index], rng, depth + 1)
        return value
    key = rng.choice(sorted(value))
    roll = rng.random()
    if roll < 0.15:
        del value[key]
    elif roll < 0.25:
        value[f"unknown_{rng.randrange(9)}"] = junk(rng)
    else:
        value[key] = mutate(value[key], rng, depth + 1)
    return value


@pytest.fixture
def app_client(monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    """The app with one served model and a stand-in for the job: every job finishes with RESULT."""
    monkeypatch.setattr(pools, "served_pools", lambda connection: {MODEL: Pool(MODEL, "kvrq", 1)})
    result = GenerationResult.model_validate(RESULT)

    async def submit(self: Bridge, request: GenerationRequest) -> AsyncJobHandle:
        GenerationRequest.model_validate(request.model_dump())  # what Producer.submit checks again
        return self.producer.handle("job-1")

    async def finished(
        self: Bridge, handle: AsyncJobHandle, *, timeout: float, gone: Any
    ) -> GenerationResult:
        gone.close()  # the wait for a disconnect, never started here
        return result

    async def events(self: Bridge, handle: AsyncJobHandle, *, timeout: float) -> AsyncIterator[StreamEvent]:
        yield StreamEvent("delta", text="Hi")
        yield StreamEvent("end", finish_reason="stop")

    async def after_end(self: Bridge, handle: AsyncJobHandle) -> GenerationResult:
        return result

    for name, stand_in in [
        ("submit", submit),
        ("result", finished),
        ("events", events),
        ("result_after_end", after_end),
    ]:
        monkeypatch.setattr(Bridge, name, stand_in)
    with TestClient(
        create_app(ServeSettings(), **app_connections()), raise_server_exceptions=False
    ) as client:
        yield client


def test_fuzzed_bodies_get_a_4xx_with_a_reason_or_an_answer(app_client: TestClient) -> None:
    for path, body in VALID.items():
        assert app_client.post(path, json=body).status_code == 200, path
    statuses: dict[int, int] = {}
    for seed in range(SEEDS):
        rng = random.Random(seed)
        path = rng.choice(sorted(VALID))
        body = mutate(VALID[path], rng)
        if rng.random() < 0.5:
            body = mutate(body, rng)
        if rng.random() < 0.05:
            raw = json.dumps(body)[: rng.randrange(1, 40)].encode()  # cut short: not JSON
        else:
            raw = json.dumps(body).encode()
        answer = app_client.post(path, content=raw, headers={"content-type": "application/json"})
        statuses[answer.status_code] = statuses.get(answer.status_code, 0) + 1
        assert answer.status_code == 200 or 400 <= answer.status_code < 500, (seed, path, raw, answer.text)
        if answer.status_code != 200:
            error = answer.json()["error"]
            assert error["message"] and error["type"], (seed, path, raw, answer.text)
    assert statuses.get(400, 0) > SEEDS / 2 and statuses.get(200, 0) > 0, statuses
    assert app_client.get("/health").json()["status"] == "ok"
