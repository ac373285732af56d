"""The Python clients, installed as users install them (pinned; llm and aider in their own venvs,
tests/clients/*.txt; the OpenAI Agents SDK from kvrq's dev extras), 3-turn sessions against kvrq
serve on the builtin SmolLM2: the `llm` CLI with an extra OpenAI model (`-c` continues), aider
(`--message`, no git, its chat history restored each run) and the Agents SDK on its Responses and
Chat Completions models, each turn re-sending the whole history (`to_input_list`). None sends a
cache key: reuse comes from the token prefix."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.clients.conftest import client_program, isolated_env
from tests.clients.session import Session
from tests.clients.stack import ClientStack

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.clients]

QUESTIONS = ("What is the capital of France?", "And of Italy?", "Thanks.")


def test_llm_cli_prompt_then_continue(builtin_stack: ClientStack, tmp_path: Path) -> None:
    llm = client_program("llm")
    user_dir = tmp_path / "llm"
    user_dir.mkdir()
    (user_dir / "extra-openai-models.yaml").write_text(
        f"- model_id: kvrq\n  model_name: {builtin_stack.model}\n  api_base: {builtin_stack.url}/v1\n"
        "  api_key_name: kvrq\n"
    )
    env = isolated_env(tmp_path / "home", LLM_USER_PATH=str(user_dir))
    session = Session(builtin_stack, tmp_path / "work")
    session.run([llm, "keys", "set", "kvrq", "--value", "unused"], env)
    greedy = ["-o", "temperature", "0", "-o", "max_tokens", "24"]
    session.run([llm, "-m", "kvrq", *greedy, QUESTIONS[0]], env)
    for question in QUESTIONS[1:]:
        session.run([llm, "-c", *greedy, question], env)
    session.check()


def test_aider_message_runs_with_restored_history(builtin_stack: ClientStack, tmp_path: Path) -> None:
    aider = client_program("aider")
    session = Session(builtin_stack, tmp_path / "work")
    model = f"openai/{builtin_stack.model}"
    (session.workdir / "settings.yml").write_text(
        f"- name: {model}\n  edit_format: whole\n  use_temperature: 0\n  extra_params:\n    max_tokens: 24\n"
    )
    env = isolated_env(tmp_path / "home", LITELLM_LOCAL_MODEL_COST_MAP="True")
    argv = [aider, "--model", model, "--openai-api-base", f"{builtin_stack.url}/v1"]
    argv += ["--openai-api-key", "unused", "--model-settings-file", "settings.yml", "--no-git"]
    argv += ["--yes-always", "--no-check-update", "--no-analytics", "--no-show-model-warnings"]
    argv += ["--no-stream", "--no-pretty", "--no-fancy-input", "--restore-chat-history", "--map-tokens", "0"]
    for question in QUESTIONS:
        session.run([*argv, "--message", question], env)
    session.check()


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_openai_agents_sdk_three_turns(builtin_stack: ClientStack, tmp_path: Path, api: str) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    session = Session(builtin_stack, tmp_path / "work")

    async def run() -> None:
        client = openai.AsyncOpenAI(base_url=f"{builtin_stack.url}/v1", api_key="unused", max_retries=0)
        kind = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
        model = kind(model=builtin_stack.model, openai_client=client)
        # Stop strings end the tiny model's answers: the SDK raises on one cut by max_tokens.
        settings = ModelSettings(max_tokens=64, temperature=0.0, extra_body={"stop": [".", "\n"]})
        agent = Agent(name="geo", instructions="Answer briefly.", model=model, model_settings=settings)
        history: list[Any] = []
        for question in QUESTIONS:
            result = await Runner.run(agent, [*history, {"role": "user", "content": question}])
            assert isinstance(result.final_output, str)
            history = result.to_input_list()
        await client.close()

    asyncio.run(run())
    session.check()
