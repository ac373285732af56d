"""Agent frameworks as people run them, unmodified, against a real `kvrq serve`, redis-server and
`kvrq worker` on the builtin model: pydantic-ai (a typed result through its forced output tool; a
function tool it calls), the OpenAI Agents SDK on its Responses model (a function tool; a second run
continuing by previous_response_id), and the anthropic SDK's tool loop. The model is tiny: these
assert the protocol (a forced call parses and validates, the loop goes round), not the answers."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import anthropic
import openai
import pydantic_ai
import pytest
from pydantic import BaseModel

from tests.http.test_integration import MODEL, ServeProcess, stack  # noqa: F401 - the module's stack

pytestmark = [pytest.mark.integration, pytest.mark.slow]


#: Agents SDK settings: greedy, and answers end at their first sentence (kvrq's `stop`, in extra_body).
SHORT: dict[str, Any] = {"max_tokens": 64, "temperature": 0.0, "extra_body": {"stop": ["."]}}


class City(BaseModel):
    name: str


def weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


@pytest.fixture(scope="module")
def url(stack: tuple[ServeProcess, Any]) -> str:  # noqa: F811 - the fixture imported above
    return stack[0].url


def chat_model(url: str) -> Any:
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    return OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=f"{url}/v1", api_key="unused"))


def test_pydantic_ai_typed_result_through_its_forced_output_tool(url: str) -> None:
    """pydantic-ai asks for a typed result with one output tool and tool_choice required, and sends its
    token limit as max_completion_tokens only: the call parses, validates, and stays in the limit."""
    agent = pydantic_ai.Agent(
        chat_model(url), output_type=City, model_settings={"max_tokens": 40, "temperature": 0.0}
    )
    result = agent.run_sync("What is the capital of France?")
    assert isinstance(result.output, City) and result.output.name
    assert 0 < result.usage.output_tokens <= 40


def test_pydantic_ai_calls_a_function_tool(url: str) -> None:
    """The tool forced on the first step (a callable setting: pydantic-ai's way to vary tool_choice per
    step), its result sent back, then a text answer with function tools off."""
    from pydantic_ai import RunContext
    from pydantic_ai.messages import ToolReturnPart

    calls: list[str] = []

    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return weather(city)

    def settings(ctx: RunContext[None]) -> Any:
        answered = any(isinstance(part, ToolReturnPart) for message in ctx.messages for part in message.parts)
        choice = "none" if answered else ["get_weather"]
        return {"max_tokens": 64, "temperature": 0.0, "tool_choice": choice, "parallel_tool_calls": False}

    agent = pydantic_ai.Agent(chat_model(url), tools=[get_weather], model_settings=settings)
    result = agent.run_sync("What is the weather in Rome?")
    assert len(calls) == 1 and calls[0]  # called once, with a string city (validated by pydantic-ai)
    assert isinstance(result.output, str)
    returned = [
        part
        for message in result.all_messages()
        for part in message.parts
        if isinstance(part, ToolReturnPart)
    ]
    assert [part.content for part in returned] == [weather(calls[0])]


def test_openai_agents_sdk_function_tool_then_a_run_by_previous_response_id(url: str) -> None:
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return weather(city)

    async def run() -> tuple[Any, Any]:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        model = OpenAIResponsesModel(model=MODEL, openai_client=client)
        agent = Agent(
            name="weather",
            instructions="You answer questions about the weather.",
            model=model,
            tools=[get_weather],
            # Forced on the first turn; the SDK resets tool_choice after a call, so the next answers. The
            # SDK raises on a response cut by max_tokens: a stop string keeps the tiny model's answers short.
            model_settings=ModelSettings(tool_choice="get_weather", parallel_tool_calls=False, **SHORT),
        )
        first = await Runner.run(agent, "What is the weather in Rome?", max_turns=4)
        second = await Runner.run(
            agent.clone(tools=[], model_settings=ModelSettings(**SHORT)),
            "Thanks!",
            previous_response_id=first.last_response_id,
            max_turns=2,
        )
        await client.close()
        return first, second

    first, second = asyncio.run(run())
    assert len(calls) == 1 and calls[0]
    kinds = [item.type for item in first.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"
    assert isinstance(first.final_output, str) and isinstance(second.final_output, str)
    last_of_first = first.raw_responses[-1].usage
    resumed = second.raw_responses[0].usage
    # The second run sent only its new message and resumed the whole first run from the kept KV.
    assert resumed.input_tokens_details.cached_tokens >= last_of_first.input_tokens


def test_anthropic_sdk_tool_runner_loop(url: str) -> None:
    """The anthropic SDK's tool runner: the tool forced on the first turn (the runner drops a forcing
    tool_choice after it), run, its result sent back with the whole history, then an answer."""
    from anthropic import beta_tool

    calls: list[str] = []

    @beta_tool
    def get_weather(city: str) -> str:
        """The weather in a city.

        Args:
            city: the city's name
        """
        calls.append(city)
        return weather(city)

    claude = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)
    runner = claude.beta.messages.tool_runner(
        model=MODEL,
        max_tokens=64,
        messages=[{"role": "user", "content": "What is the weather in Rome?"}],
        tools=[get_weather],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        stop_sequences=["."],
        thread=False,
        max_iterations=3,
        metadata={"user_id": "frameworks-anthropic"},
        extra_body={"temperature": 0},
    )
    replies = list(runner)
    assert len(calls) >= 1 and calls[0]
    first = replies[0]
    assert first.stop_reason == "tool_use"
    (use,) = [block for block in first.content if block.type == "tool_use"]
    assert use.name == "get_weather" and json.loads(json.dumps(use.input)) == {"city": calls[0]}
    assert len(replies) >= 2  # the loop went round: the tool's result came back to the model
    assert (
        replies[1].usage.cache_read_input_tokens is not None and replies[1].usage.cache_read_input_tokens > 0
    )
