"""The Python clients, installed as users install them (pinned; llm and aider in their own venvs,
tests/clients/*.txt; the OpenAI Agents SDK from kvrq's dev extras), 3-turn sessions against kvrq
serve on the builtin SmolLM2: the `llm` CLI with an extra OpenAI model (`-c` continues), aider
(`--message`, no git, its chat history restored each run) and the Agents SDK on its Responses and
Chat Completions models, each turn re-sending the whole history. None sends a cache key: reuse
comes from the token prefix."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.clients import drivers
from tests.clients.stack import ClientStack

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.clients]


def test_llm_cli_prompt_then_continue(builtin_stack: ClientStack, tmp_path: Path) -> None:
    drivers.llm_cli(builtin_stack, tmp_path).check()


def test_aider_message_runs_with_restored_history(builtin_stack: ClientStack, tmp_path: Path) -> None:
    drivers.aider(builtin_stack, tmp_path).check()


#: Server side, not done (issue 42 item 6): measured at 6100f7a + the server work in progress.


@pytest.mark.parametrize(
    "api",
    [
        "responses",
        "chat",
    ],
)
def test_openai_agents_sdk_three_turns(builtin_stack: ClientStack, tmp_path: Path, api: str) -> None:
    drivers.agents_sdk(builtin_stack, tmp_path, api).check()
