"""`kvrq serve` driven by the official `openai` and `anthropic` clients, against a real server process,
redis-server and `kvrq worker` on the builtin model (few tokens each: the module runs in under a minute).

The anthropic client of 2026 has no `temperature` any more (the API samples as it sees fit); kvrq still
takes it, so greedy runs pass it in `extra_body`."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from redis import Redis
from rq.job import Job

from benchmarks import procs as shared
from tests.worker.procs import RedisProcess, WorkerProcess, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "smollm2-135m"
MAX_BODY_MB = 0.05  # 52,428 bytes: the 413 test sends more
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}


class ServeProcess(shared.ServeProcess):
    """benchmarks/procs.py's `kvrq serve`, with this module's small body limit (the 413 test)."""

    def __init__(self, redis_url: str, workdir: Path, args: Sequence[str] = ()) -> None:
        """`args`: more `kvrq serve` options (an API key file)."""
        super().__init__(redis_url, workdir, ["--max-body-mb", str(MAX_BODY_MB), *args])


@contextlib.contextmanager
def serve_stack(
    workdir: Path, worker_name: str, model: str = MODEL, worker_args: Sequence[str] = ()
) -> Iterator[tuple[ServeProcess, str]]:
    """A redis-server, one `kvrq worker` (`worker_args`: its model) and `kvrq serve` serving `model`;
    (the server, the Redis URL) while they run, all stopped after."""
    redis = RedisProcess(workdir)
    redis.start()
    worker = WorkerProcess(redis.url, workdir, name=worker_name, args=list(worker_args))
    server = ServeProcess(redis.url, workdir)
    try:
        worker.start()
        wait_for(
            lambda: server.serves(model) or server.proc.poll() is not None, 60, "kvrq serve did not start"
        )
        assert server.proc.poll() is None, server.log()
        yield server, redis.url
    finally:
        server.stop()
        worker.stop()
        redis.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, Redis]]:
    with serve_stack(tmp_path_factory.mktemp("http"), "http-worker") as (server, redis_url):
        yield server, Redis.from_url(redis_url)


@pytest.fixture(scope="module")
def client(stack: tuple[ServeProcess, Redis]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack[0].url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(stack: tuple[ServeProcess, Redis]) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack[0].url, api_key="unused", max_retries=0, timeout=60)


def test_models_lists_the_workers_model(client: openai.OpenAI) -> None:
    assert [model.id for model in client.models.list()] == [MODEL]


def test_chat_then_a_second_turn_resumes_the_agents_cache(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,  # type: ignore[arg-type]
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        prompt_cache_key="http-alice",
    )
    choice = first.choices[0]
    assert first._request_id == first.id.removeprefix("chatcmpl-")  # the job id
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert len(choice.logprobs.content[0].top_logprobs) == 2
    assert first.usage is not None and first.usage.prompt_tokens > 0
    assert first.usage.completion_tokens == len(choice.logprobs.content) + (choice.finish_reason == "stop")
    history = [*QUESTION, {"role": "assistant", "content": choice.message.content}]
    second = client.chat.completions.create(
        model=MODEL,
        messages=[*history, {"role": "user", "content": "And of Italy?"}],  # type: ignore[arg-type]
        max_tokens=4,
        temperature=0,
        prompt_cache_key="http-alice",
    )
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens


def test_streamed_chat_ends_with_usage_and_done(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,  # type: ignore[arg-type]
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens <= 5
    plain = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5, temperature=0)  # type: ignore[arg-type]
    assert plain.choices[0].message.content == text  # greedy: streamed or not, the same answer


def test_completions_take_a_prompt(client: openai.OpenAI) -> None:
    completion = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0
    )
    assert (
        completion.choices[0].text
        and completion.usage is not None
        and completion.usage.completion_tokens == 3
    )


def test_anthropic_messages_plain_and_streamed(claude: anthropic.Anthropic) -> None:
    message = claude.messages.create(
        model=MODEL,
        max_tokens=5,
        extra_body=GREEDY,
        system="Answer in one word.",
        messages=QUESTION,  # type: ignore[arg-type]
        metadata={"user_id": "http-bob"},
    )
    assert message.role == "assistant" and message.content[0].type == "text" and message.content[0].text
    assert message._request_id == message.id.removeprefix("msg_")
    assert message.stop_reason in ("end_turn", "max_tokens") and message.usage.output_tokens <= 5
    with claude.messages.stream(
        model=MODEL,
        max_tokens=5,
        extra_body=GREEDY,
        system="Answer in one word.",
        messages=QUESTION,  # type: ignore[arg-type]
    ) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == message.content[0].text  # greedy: the same answer
    assert final.usage.output_tokens == message.usage.output_tokens
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) > 0
    count = claude.messages.count_tokens(model=MODEL, system="Answer in one word.", messages=QUESTION)  # type: ignore[arg-type]
    assert count.input_tokens == message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)


def test_a_client_that_disconnects_cancels_its_job(
    client: openai.OpenAI, stack: tuple[ServeProcess, Redis]
) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Write a very long story about a dragon."}],
        max_tokens=2000,
        stream=True,
    )
    job_id = next(iter(stream)).id.removeprefix("chatcmpl-")
    stream.close()
    job = Job(job_id, connection=stack[1])
    wait_for(lambda: job.get_status(refresh=True) in ("canceled", "stopped"), 15, "the job was not canceled")


def test_errors_are_each_apis_own(
    client: openai.OpenAI, claude: anthropic.Anthropic, stack: tuple[ServeProcess, Redis]
) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4o", messages=QUESTION, max_tokens=2)  # type: ignore[arg-type]
    assert missing.value.code == "model_not_found" and MODEL in missing.value.message
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-x", max_tokens=2, messages=QUESTION)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, top_p=0)  # type: ignore[arg-type]
    assert "top_p" in bad.value.message
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model=MODEL, max_tokens=0, messages=QUESTION)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError) as failed:  # the worker refuses it: before any output
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,  # type: ignore[arg-type]
            max_tokens=2,
            logit_bias={"999999": 1},  # past the vocabulary
            stream=True,
        )
    assert failed.value.code == "invalid_request" and "999999" in failed.value.message
    huge = [{"role": "user", "content": "x" * int(MAX_BODY_MB * 1024 * 1024)}]
    with pytest.raises(openai.APIStatusError) as too_large:
        client.chat.completions.create(model=MODEL, messages=huge, max_tokens=2)  # type: ignore[arg-type]
    assert too_large.value.status_code == 413
    assert stack[0].serves(MODEL)  # and the server is still up


def test_seeded_sampling_repeats_itself(client: openai.OpenAI) -> None:
    """Samplers reach the worker: the same seed samples the same answer (top_k and min_p in extra_body,
    as OpenAI's client has no argument for them)."""
    answers = {
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,  # type: ignore[arg-type]
            max_tokens=6,
            temperature=1.2,
            top_p=0.95,
            seed=11,
            presence_penalty=0.5,
            extra_body={"top_k": 40, "min_p": 0.02},
        )
        .choices[0]
        .message.content
        for _ in range(2)
    }
    assert len(answers) == 1 and answers != {""}


LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup_capital",
        "description": "The capital city of a country",
        "parameters": {
            "type": "object",
            "properties": {"country": {"type": "string", "maxLength": 40}},
            "required": ["country"],
            "additionalProperties": False,
        },
    },
}


def test_forced_tool_calls_and_json_output_on_the_builtin(
    client: openai.OpenAI, claude: anthropic.Anthropic
) -> None:
    """What pydantic-ai and BFCL-style clients send, on a model whose template declares no tools: a call
    forced by tool_choice "required" (OpenAI) and {"type": "tool"} (Anthropic), and a json_schema answer."""
    forced = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,  # type: ignore[arg-type]
        tools=[LOOKUP],  # type: ignore[list-item]
        tool_choice="required",
        parallel_tool_calls=False,  # a 135M model left free calls again and again until max_tokens
        max_completion_tokens=48,
        **GREEDY,
    )
    choice = forced.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    (call,) = choice.message.tool_calls
    assert call.function.name == "lookup_capital"  # type: ignore[union-attr]
    assert set(json.loads(call.function.arguments)) == {"country"}  # type: ignore[union-attr]

    parallel = client.chat.completions.create(  # OpenAI's default: parallel calls allowed
        model=MODEL,
        messages=QUESTION,  # type: ignore[arg-type]
        tools=[LOOKUP],  # type: ignore[list-item]
        tool_choice="required",
        max_completion_tokens=120,
        **GREEDY,
    )
    choice = parallel.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls  # ended at its repeat
    assert len({c.function.arguments for c in choice.message.tool_calls}) == len(choice.message.tool_calls)  # type: ignore[union-attr]
    assert parallel.usage is not None and parallel.usage.completion_tokens < 120

    message = claude.messages.create(
        model=MODEL,
        max_tokens=48,
        messages=QUESTION,  # type: ignore[arg-type]
        tools=[{"name": "lookup_capital", "input_schema": LOOKUP["function"]["parameters"]}],  # type: ignore[index]
        tool_choice={"type": "tool", "name": "lookup_capital", "disable_parallel_tool_use": True},
        extra_body=GREEDY,
    )
    assert message.stop_reason == "tool_use"
    uses = [block for block in message.content if block.type == "tool_use"]
    assert [use.name for use in uses] == ["lookup_capital"] and set(uses[0].input) == {"country"}  # type: ignore[arg-type]

    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string", "maxLength": 40}},
        "required": ["capital"],
    }
    answered = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,  # type: ignore[arg-type]
        response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema}},
        max_completion_tokens=48,
        **GREEDY,
    )
    assert answered.choices[0].finish_reason == "stop"
    assert set(json.loads(answered.choices[0].message.content or "")) == {"capital"}


def test_a_continued_turn_sends_only_its_new_message(
    client: openai.OpenAI, claude: anthropic.Anthropic
) -> None:
    remember = {"kvrq": {"continue": True}}
    first = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,  # type: ignore[arg-type]
        max_tokens=6,
        temperature=0,
        prompt_cache_key="http-memory",
        extra_body=remember,
    )
    second = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "And of Italy?"}],
        max_tokens=4,
        temperature=0,
        prompt_cache_key="http-memory",
        extra_body=remember,
    )
    assert first.usage is not None and second.usage is not None
    assert second.usage.prompt_tokens_details is not None
    first_turn = first.usage.prompt_tokens + first.usage.completion_tokens
    assert second.usage.prompt_tokens > first_turn  # the stored conversation came back
    assert second.usage.prompt_tokens_details.cached_tokens >= first_turn - 1
    third = claude.messages.create(
        model=MODEL,
        max_tokens=4,
        messages=[{"role": "user", "content": "And of Spain?"}],
        metadata={"user_id": "http-memory"},
        extra_body={**remember, **GREEDY},
    )
    assert third.usage.cache_read_input_tokens is not None
    assert (
        third.usage.cache_read_input_tokens >= second.usage.prompt_tokens + second.usage.completion_tokens - 1
    )
    bad = httpx.post(
        f"{str(client.base_url).rstrip('/')}/chat/completions",
        json={"model": MODEL, "messages": QUESTION, "kvrq": {"continue": True}},
        timeout=30,
    )
    assert bad.status_code == 400 and "agent_id" in bad.json()["error"]["message"]
