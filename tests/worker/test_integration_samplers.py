"""Samplers, logit_bias, logprobs, response_format and forced tool calls through a real worker with the
builtin model (few tokens), and the values only the worker can judge (a logit_bias id past the vocabulary,
a schema the grammar library cannot enforce, response_format with tools the model may call) failed as
invalid_request when the job is taken, before it waits for a batch slot.

The exact equality of each sampler and processor with mlx-lm's own is tested on a tiny model
(tests/engine/test_row_processors.py); here the point is that every field reaches the engine."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from producer.client import JobFailedError, Producer
from producer.wire.protocol import ErrorCode
from tests.worker.procs import RedisProcess, WorkerProcess, exits_cleanly, module_redis

pytestmark = [pytest.mark.integration, pytest.mark.slow]

VOCAB = 49152  # the builtin tokenizer's
QUESTION = [{"role": "user", "content": "Name three colours of the rainbow."}]


redis_proc = module_redis("samplers")


@pytest.fixture(scope="module")
def producer(redis_proc: RedisProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Producer]:
    workdir = tmp_path_factory.mktemp("worker-samplers")
    worker = WorkerProcess(redis_proc.url, workdir, name="kvrq-samplers", args=["--max-batch", "8"])
    with exits_cleanly(worker), Producer(redis_proc.url) as p:
        yield p


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": QUESTION, "max_tokens": 8, **fields}


def test_samplers_processors_and_logprobs_reach_the_engine_in_one_batch(producer: Producer) -> None:
    requests = {
        "greedy": chat(),
        "greedy+logprobs": chat(logprobs=True, top_logprobs=3),
        "top_k=1 sampled": chat(temperature=1.0, top_k=1, seed=3),
        "sampled a": chat(
            temperature=1.0, top_k=40, min_p=0.05, repetition_penalty=1.2, presence_penalty=0.5, seed=7
        ),
        "sampled b": chat(
            temperature=1.0, top_k=40, min_p=0.05, repetition_penalty=1.2, presence_penalty=0.5, seed=7
        ),
    }
    handles = dict(zip(requests, producer.submit_many(list(requests.values())), strict=True))  # one batch
    results = {name: handle.result(timeout=300) for name, handle in handles.items()}
    greedy = results["greedy"]

    with_logprobs = results["greedy+logprobs"]
    assert with_logprobs.token_ids == greedy.token_ids and greedy.logprobs is None
    assert with_logprobs.logprobs is not None and len(with_logprobs.logprobs) == len(greedy.token_ids)
    for token, entry in zip(greedy.token_ids, with_logprobs.logprobs, strict=True):
        assert entry.token_id == token and entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token_id == token  # greedy: the chosen token is the most likely
        values = [top.logprob for top in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and entry.logprob == pytest.approx(values[0])
    assert "".join(entry.token for entry in with_logprobs.logprobs) == with_logprobs.text

    assert results["top_k=1 sampled"].token_ids == greedy.token_ids  # top_k=1 leaves the argmax only
    assert results["sampled a"].token_ids == results["sampled b"].token_ids  # same seed, same draws


def test_logit_bias_steers_the_answer_and_logprobs_stream_as_events(producer: Producer) -> None:
    greedy = producer.submit(chat(max_tokens=4)).result(timeout=300)
    banned = producer.submit(chat(max_tokens=4, logit_bias={str(greedy.token_ids[0]): -100})).result(
        timeout=300
    )
    assert banned.token_ids[0] != greedy.token_ids[0]

    handle = producer.submit(chat(max_tokens=4, logprobs=True))
    events = list(handle.events(timeout=300))
    logprobs = [event.data for event in events if event.kind == "logprobs"]
    result = handle.result(timeout=60)
    assert result.logprobs is not None
    assert logprobs == [entry.model_dump(mode="json") for entry in result.logprobs]
    assert "".join(handle.stream(timeout=60)) == result.text  # stream() still yields the text alone


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"logit_bias": {str(VOCAB): 5}},
            rf"logit_bias token id {VOCAB} is outside the vocabulary \[0, {VOCAB}\)",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "get_weather"}}],
                "response_format": {"type": "json_object"},
            },
            "the tools offered could never be called",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "broken", "schema": {"$ref": "#/definitions/missing"}},
                }
            },
            "response_format schema 'broken' cannot be enforced",
        ),
    ],
)
def test_values_only_the_worker_can_judge_fail_as_invalid_request(
    producer: Producer, fields: dict[str, Any], message: str
) -> None:
    handle = producer.submit(chat(**fields))
    with pytest.raises(JobFailedError, match=message) as failed:
        handle.result(timeout=300)
    assert failed.value.code == ErrorCode.INVALID_REQUEST
    # Refused when the job was taken (JobRejected, PromptError), not by the engine at admission.
    assert failed.value.reason.startswith(("JobRejected: invalid request: ", "PromptError: "))


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colours": {
            "type": "array",
            "items": {"enum": ["red", "orange", "yellow", "green", "blue"]},
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "colours"],
    "additionalProperties": False,
}


def test_response_format_holds_each_row_to_its_own_grammar_in_one_batch(producer: Producer) -> None:
    """A json_schema row, a json_object row and a plain row submitted together: the first two answer
    in JSON (the schema's, any object), ended by their grammar; the plain row answers as it does alone."""
    person = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    plain_alone = producer.submit(chat(max_tokens=12)).result(timeout=300)
    handles = producer.submit_many(
        [
            chat(max_tokens=96, response_format=person),
            chat(max_tokens=96, response_format={"type": "json_object"}),
            chat(max_tokens=12),
            chat(max_tokens=96, response_format=person, temperature=1.0, seed=11),
        ]
    )
    schema_row, object_row, plain, sampled_row = (h.result(timeout=300) for h in handles)
    for row in (schema_row, sampled_row):
        assert row.finish_reason == "stop", row.text
        jsonschema.validate(json.loads(row.text), PERSON)
    assert object_row.finish_reason == "stop", object_row.text
    assert isinstance(json.loads(object_row.text), dict)
    assert plain.token_ids == plain_alone.token_ids


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 32}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def test_the_builtin_calls_a_forced_tool_and_resumes_after_its_result(producer: Producer) -> None:
    """SmolLM2's template declares no tool calling: kvrq writes the tools into the system message and the
    call into the history; tool_choice "required" makes the answer a valid call; the round trip's second
    turn resumes the agent's KV past the first turn's whole prompt."""
    ask = {"role": "user", "content": "What is the weather in Paris?"}
    first = {
        "agent_id": "builtin-tools",
        "messages": [ask],
        "tools": [WEATHER],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 48,
    }
    called = producer.submit(first).result(timeout=300)
    assert called.finish_reason == "tool_calls" and called.text == ""
    assert called.tool_calls is not None and len(called.tool_calls) == 1
    (call,) = called.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])  # type: ignore[index]

    history = [
        ask,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(mode="json")]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"},
    ]
    final = producer.submit({**first, "messages": history, "tool_choice": "auto", "max_tokens": 8}).result(
        timeout=300
    )  # the tools offered again, as clients send them: the model decides
    assert final.usage.reused_tokens >= called.usage.prompt_tokens
