"""A tool round trip through `kvrq serve` with the official clients, on the rigged tool-calling model of
tests/worker/test_integration_tools.py (a tiny llama whose output is known when greedy: it calls
get_weather for Paris, and answers "Sun" once a logit_bias outweighs its wish to call again)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest
from tokenizers import Tokenizer

from tests.http.test_integration import ServeProcess, serve_stack
from tests.worker.test_integration_tools import ANSWER, QUESTION, WEATHER, model_folder

pytestmark = [pytest.mark.integration, pytest.mark.slow]
__all__ = ["model_folder"]  # the fixture, shared

AGENT = "http-tool-agent"


@pytest.fixture(scope="module")
def server(model_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    workdir = tmp_path_factory.mktemp("http-tools")
    with serve_stack(workdir, "http-tools", str(model_folder), ["--model", str(model_folder)]) as (serve, _):
        yield serve


def test_openai_tool_call_result_and_answer(server: ServeProcess, model_folder: Path) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = str(model_folder)
    first = client.chat.completions.create(
        model=model,
        messages=[QUESTION],  # type: ignore[list-item]
        tools=[WEATHER],  # type: ignore[list-item]
        parallel_tool_calls=False,
        max_tokens=8,
        temperature=0,
        prompt_cache_key=AGENT,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    streamed = list(
        client.chat.completions.create(
            model=model,
            messages=[QUESTION],
            tools=[WEATHER],
            parallel_tool_calls=False,
            max_tokens=8,
            temperature=0,
            stream=True,  # type: ignore[list-item]
        )
    )
    calls = [tc for chunk in streamed if chunk.choices for tc in chunk.choices[0].delta.tool_calls or ()]
    assert [(tc.index, tc.function and tc.function.name) for tc in calls] == [(0, "get_weather")]
    assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == "tool_calls"

    answer_token = (
        Tokenizer.from_file(str(model_folder / "tokenizer.json"))
        .encode(ANSWER, add_special_tokens=False)
        .ids[0]
    )
    history = [
        QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"},
    ]
    final = client.chat.completions.create(
        model=model,
        messages=history,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        parallel_tool_calls=False,
        max_tokens=8,
        logit_bias={str(answer_token): 20},
        temperature=0,
        prompt_cache_key=AGENT,
    )
    assert final.choices[0].message.content == ANSWER and final.choices[0].finish_reason == "stop"
    assert (
        first.usage is not None and final.usage is not None and final.usage.prompt_tokens_details is not None
    )
    assert final.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens  # the call, resumed


def test_anthropic_tool_use_plain_and_streamed(server: ServeProcess, model_folder: Path) -> None:
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    function = WEATHER["function"]
    request = {
        "model": str(model_folder),
        "max_tokens": 8,
        "messages": [QUESTION],
        "tools": [
            {
                "name": function["name"],
                "description": function["description"],
                "input_schema": function["parameters"],
            }
        ],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
        "extra_body": {"temperature": 0},  # greedy (the 2026 client has no temperature argument)
    }
    message = client.messages.create(**request)  # type: ignore[call-overload]
    assert message.stop_reason == "tool_use"
    (block,) = message.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.input == {"city": "Paris"}
    with client.messages.stream(**request) as stream:  # type: ignore[call-overload]
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "input", None)) for b in final.content] == [("tool_use", {"city": "Paris"})]
