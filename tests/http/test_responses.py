"""`/v1/responses` and `/v1/conversations` driven by the official `openai` client against a real `kvrq
serve` and redis-server, with a stand-in worker that answers each job from its payload (so the job a
request became can be read back: its agent, `continue`, `fork_from`, messages). The state is the
point here; tests/http/test_frameworks.py runs the real worker and model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any
from unittest import mock

import openai
import pytest
from redis import Redis
from rq.job import Job, JobStatus
from rq.results import Result
from rq.serializers import JSONSerializer

from producer.conversation import read_conversation
from producer.wire.protocol import StreamEvent, agent_conversation_key, stream_key
from tests.http import test_load
from tests.http.test_integration import ServeProcess
from tests.http.test_load import MODEL, StandInWorker

pytestmark = [pytest.mark.integration]

WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
TIME: Any = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}
REUSED = 7  # the stand-in's reused tokens for a job that extends a conversation


class ScriptedWorker(StandInWorker):
    """Answers `echo:<last message>` in three deltas; with tools and a required or named tool_choice
    it calls the tool instead; with enable_thinking it thinks first. Keeps every payload it ran."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.payloads: list[dict[str, Any]] = []

    def answer(self, job_id: str) -> None:
        job = Job.fetch(job_id, connection=self.connection, serializer=JSONSerializer)
        payload = job.args[0]
        self.payloads.append(payload)
        events = [StreamEvent("start", attempt="1")]
        result: dict[str, Any] = {"text": "", "reasoning": None, "tool_calls": None}
        if (payload.get("chat_template_kwargs") or {}).get("enable_thinking"):
            result["reasoning"] = "let me think"
            events.append(StreamEvent("reasoning", text="let me think"))
        choice, tools = payload.get("tool_choice"), payload.get("tools")
        if tools and (choice == "required" or isinstance(choice, dict)):
            name = choice["function"]["name"] if isinstance(choice, dict) else tools[0]["function"]["name"]
            call = {
                "id": f"call_{len(self.payloads)}",
                "type": "function",
                "function": {"name": name, "arguments": '{"city": "Rome"}'},
            }
            result["tool_calls"] = [call]
            events.append(StreamEvent("tool_call", data=call))
            finish = "tool_calls"
        else:
            text = "echo:" + str(payload["messages"][-1]["content"])
            result["text"] = text
            events += [StreamEvent("delta", text=part, token=1) for part in (text[:3], text[3:6], text[6:])]
            finish = "length" if payload.get("max_tokens", 256) < 3 else "stop"
        extends = payload.get("continue") and len(self.payloads) > 1 or payload.get("fork_from")
        value = {
            **result,
            "job_id": job_id,
            "agent_id": payload.get("agent_id"),
            "token_ids": [1, 1, 1],
            "finish_reason": finish,
            "usage": {
                "prompt_tokens": 20,
                "reused_tokens": REUSED if extends else 0,
                "prefilled_tokens": 20 - (REUSED if extends else 0),
                "generated_tokens": 3,
            },
            "timings": {"queued_s": 0.0, "time_to_first_token_s": 0.0, "total_s": 0.0},
        }
        with self.connection.pipeline() as pipe:
            for event in [*events, StreamEvent("end", finish_reason=finish)]:
                pipe.xadd(stream_key(job_id), event.to_fields())  # type: ignore[arg-type]
            Result.create(job, Result.Type.SUCCESSFUL, ttl=600, return_value=value, pipeline=pipe)
            job.set_status(JobStatus.FINISHED, pipeline=pipe)
            pipe.execute()
        self.jobs += 1


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, ScriptedWorker]]:
    """test_load's stack (redis-server, the stand-in, `kvrq serve`) with the scripted stand-in."""
    with mock.patch.object(test_load, "StandInWorker", ScriptedWorker):
        running = test_load.stand_in_stack(tmp_path_factory.mktemp("responses"))
        server, worker = running.__enter__()
    try:
        assert isinstance(worker, ScriptedWorker)
        yield server, worker
    finally:
        running.__exit__(None, None, None)


@pytest.fixture(scope="module")
def client(stack: tuple[ServeProcess, ScriptedWorker]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack[0].url}/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture
def worker(stack: tuple[ServeProcess, ScriptedWorker]) -> ScriptedWorker:
    return stack[1]


def stored(worker: ScriptedWorker) -> set[bytes]:
    """Every Responses record in Redis."""
    redis: Redis = worker.connection
    return set(redis.scan_iter("kvrq:response:*")) | set(redis.scan_iter("kvrq:conversation:*"))


def test_a_response_starts_its_own_agent_and_a_follow_up_forks_it(
    client: openai.OpenAI, worker: ScriptedWorker
) -> None:
    first = client.responses.create(model=MODEL, input="Hi", instructions="Be brief.", temperature=0)
    assert first.id.startswith("resp_") and len(first.id) == 53
    assert first.status == "completed" and first.output_text == "echo:Hi"
    assert first._request_id == first.model_dump()["kvrq"]["job_id"]
    job = worker.payloads[-1]
    assert job["agent_id"] == f"responses:{first.id}" and job["continue"] is True and "fork_from" not in job
    assert job["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    branches = []
    for words in ("And Spain?", "And Italy?"):  # two follow-ups of one response: two branches
        branches.append(
            client.responses.create(
                model=MODEL, input=words, instructions="Be brief.", previous_response_id=first.id
            )
        )
        job = worker.payloads[-1]
        assert job["fork_from"] == f"responses:{first.id}"
        assert job["agent_id"] == f"responses:{branches[-1].id}"
        assert job["messages"] == [{"role": "user", "content": words}]  # only the new input
        assert branches[-1].previous_response_id == first.id
        assert branches[-1].usage is not None
        assert branches[-1].usage.input_tokens_details.cached_tokens == REUSED
    assert branches[0].id != branches[1].id
    assert client.responses.retrieve(branches[1].id).output_text == "echo:And Italy?"
    assert [
        item.model_dump()["content"][0]["text"] for item in client.responses.input_items.list(branches[0].id)
    ] == ["And Spain?"]


def test_changed_instructions_come_as_a_system_message_before_the_new_input(
    client: openai.OpenAI, worker: ScriptedWorker
) -> None:
    first = client.responses.create(model=MODEL, input="Hi", instructions="A")
    client.responses.create(model=MODEL, input="Hi again", instructions="B", previous_response_id=first.id)
    assert worker.payloads[-1]["messages"] == [
        {"role": "system", "content": "B"},
        {"role": "user", "content": "Hi again"},
    ]


def test_a_stream_is_the_responses_event_sequence_and_ends_with_the_stored_response(
    client: openai.OpenAI,
) -> None:
    with client.responses.stream(model=MODEL, input="Hello", reasoning={"effort": "low"}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",  # the reasoning
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",  # the message
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert final.output_text == "echo:Hello"
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == "let me think"  # type: ignore[union-attr,index]
    again = client.responses.retrieve(final.id)  # the stream's last event is what was stored
    assert [item.model_dump()["id"] for item in again.output] == [
        item.model_dump()["id"] for item in final.output
    ]
    assert (again.output_text, again.usage, again.status) == (final.output_text, final.usage, final.status)


def test_a_forced_call_and_its_output_on_the_next_turn(client: openai.OpenAI, worker: ScriptedWorker) -> None:
    tools: Any = [WEATHER, TIME]
    with client.responses.stream(
        model=MODEL,
        input="Weather in Rome?",
        tools=tools,
        tool_choice={"type": "function", "name": "get_weather"},
    ) as stream:
        events = list(stream)
        first = stream.get_final_response()
    assert "response.function_call_arguments.done" in [event.type for event in events]
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Rome"}
    assert worker.payloads[-1]["tools"][0] == {
        "type": "function",
        "function": {k: v for k, v in WEATHER.items() if k != "type"},
    }
    answer = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        tools=tools,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
    )
    assert worker.payloads[-1]["messages"] == [
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}
    ]
    assert answer.output_text == "echo:sunny"


def test_allowed_tools_narrow_the_tools_and_text_format_is_the_schema(
    client: openai.OpenAI, worker: ScriptedWorker
) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    client.responses.create(  # type: ignore[call-overload]
        model=MODEL,
        input="x",
        tools=[WEATHER, TIME],
        tool_choice={
            "type": "allowed_tools",
            "mode": "required",
            "tools": [{"type": "function", "name": "get_time"}],
        },
        text={"format": {"type": "json_schema", "name": "A", "schema": schema, "strict": True}},
        max_output_tokens=16,
        store=False,
    )
    job = worker.payloads[-1]
    assert [tool["function"]["name"] for tool in job["tools"]] == ["get_time"]
    assert job["tool_choice"] == "required" and job["max_tokens"] == 16
    assert job["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "A", "schema": schema, "strict": True},
    }
    assert "agent_id" not in job  # store: false, nothing to follow up


def test_store_false_keeps_nothing_and_delete_forgets(client: openai.OpenAI, worker: ScriptedWorker) -> None:
    loose = client.responses.create(model=MODEL, input="x", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(loose.id)
    kept = client.responses.create(model=MODEL, input="y")
    conversation = agent_conversation_key(f"responses:{kept.id}")
    worker.connection.set(conversation, b"{}")  # what a real worker keeps for the agent
    client.responses.delete(kept.id)
    assert read_conversation(worker.connection, f"responses:{kept.id}") is None  # a tombstone now
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input="z", previous_response_id=kept.id)


def test_length_ends_incomplete(client: openai.OpenAI) -> None:
    cut = client.responses.create(model=MODEL, input="long", max_output_tokens=2)
    assert cut.status == "incomplete" and cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize(
    ("request_body", "status", "says"),
    [
        ({"input": "x", "previous_response_id": "resp_" + "0" * 48}, 400, "not found"),
        ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "1"}]}, 400, "'nope'"),
        (
            {"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}},
            400,
            "other",
        ),
        (  # a hosted tool is left out of the prompt (named in x-kvrq-ignored): forcing it cannot be
            {"input": "x", "tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}},
            400,
            "web_search",
        ),
        ({"input": "x", "conversation": "conv_" + "0" * 48}, 404, "not found"),
        ({"input": "x", "background": True}, 400, "background"),
        (
            {"input": [{"type": "message", "role": "user", "content": [{"type": "input_image"}]}]},
            400,
            "input_image",
        ),
    ],
)
def test_bad_requests_get_openais_errors_and_store_nothing(
    stack: tuple[ServeProcess, ScriptedWorker], request_body: dict[str, Any], status: int, says: str
) -> None:
    import httpx

    server, worker = stack
    before, jobs = stored(worker), len(worker.payloads)
    answer = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, **request_body}, timeout=10)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert says in error["message"] and error["type"] == "invalid_request_error"
    assert stored(worker) == before and len(worker.payloads) == jobs


def test_a_function_call_output_answers_a_call_of_the_previous_response_only(
    client: openai.OpenAI,
) -> None:
    first = client.responses.create(model=MODEL, input="Weather?", tools=[WEATHER], tool_choice="required")
    other = client.responses.create(model=MODEL, input="unrelated")
    call_id = first.output[0].call_id  # type: ignore[union-attr]
    with pytest.raises(openai.BadRequestError, match=call_id):
        client.responses.create(
            model=MODEL,
            previous_response_id=other.id,
            input=[{"type": "function_call_output", "call_id": call_id, "output": "sunny"}],
        )


def test_a_conversation_is_one_agent_continued(client: openai.OpenAI, worker: ScriptedWorker) -> None:
    conversation = client.conversations.create(
        items=[{"type": "message", "role": "user", "content": "My name is Ada."}], metadata={"topic": "names"}
    )
    assert conversation.id.startswith("conv_") and conversation.metadata == {"topic": "names"}
    first = client.responses.create(
        model=MODEL, input="Hi", instructions="Kind.", conversation=conversation.id
    )
    job = worker.payloads[-1]
    assert job["agent_id"] == f"conversations:{conversation.id}" and job["continue"] is True
    assert job["messages"] == [
        {"role": "system", "content": "Kind."},
        {"role": "user", "content": "My name is Ada."},
        {"role": "user", "content": "Hi"},
    ]
    assert first.conversation is not None and first.conversation.id == conversation.id
    client.responses.create(
        model=MODEL, input="Who am I?", instructions="Kind.", conversation=conversation.id
    )
    assert worker.payloads[-1]["messages"] == [{"role": "user", "content": "Who am I?"}]
    items = list(client.conversations.items.list(conversation.id, order="asc"))
    texts = [item.model_dump()["content"][0]["text"] for item in items]
    assert texts == ["My name is Ada.", "Hi", "echo:Hi", "Who am I?", "echo:Who am I?"]
    assert [item.model_dump()["role"] for item in items] == ["user", "user", "assistant", "user", "assistant"]
    assert client.conversations.retrieve(conversation.id).id == conversation.id
    client.conversations.delete(conversation.id)
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conversation.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="x", conversation=conversation.id)
