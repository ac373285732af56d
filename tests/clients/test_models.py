"""The tool-call test model without a CLI (fast): it answers its call while the conversation holds
none, and `Done` once the call and its result are in the conversation, as the CLI tests rely on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load

from tests.clients.models import FINAL, MARKER, tool_call_text, write_tool_call_model
from worker.requests.tool_format import written_into_messages

CALLS = {  # each CLI's, as tests/clients/test_tool_calls.py has the model call it
    "claude": ("Bash", "command"),
    "codex": ("exec_command", "cmd"),  # `_` twice: before the marker (tool_call) and after it
    "opencode": ("bash", "command"),
}
SYSTEM = "You are an agent. Answer briefly and use your tools. " * 40


def greedy(model: Any, tokenizer: Any, messages: list[dict[str, Any]], limit: int = 40) -> tuple[str, bool]:
    """The answer, and whether it ended with end of turn rather than at `limit`."""
    prompt = mx.array(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    out: list[int] = []
    for token, _ in generate_step(prompt, model, max_tokens=limit):  # argmax by default
        if token in tokenizer.eos_token_ids:
            return tokenizer.decode(out), True
        out.append(int(token))
    return tokenizer.decode(out), False


@pytest.mark.parametrize("client", sorted(CALLS))
def test_the_model_calls_once_then_answers_done(client: str, tmp_path: Path) -> None:
    name, key = CALLS[client]
    call = tool_call_text(name, {key: f"cat{MARKER}.txt"})
    model, tokenizer = load(str(write_tool_call_model(tmp_path / "model", call)))[:2]
    asked = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Show me the notes."}]
    assert greedy(model, tokenizer, asked) == (call, True)

    arguments = json.dumps({key: f"cat{MARKER}.txt"})
    # the call and its result as kvrq writes them for the builtin template
    sent_back: list[dict[str, Any]] = [
        *asked,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": name, "arguments": arguments}}],
        },
        {"role": "tool", "content": "some notes"},
    ]
    assert greedy(model, tokenizer, written_into_messages(sent_back, None)) == (FINAL, True)


def test_a_call_whose_tokens_repeat_is_refused(tmp_path: Path) -> None:
    """Two `":` before the marker: the chain could not tell their successors apart."""
    call = f'<tool_call>{{"name": "bash", "arguments": {{"command": "cat{MARKER}.txt"}}}}'
    with pytest.raises(AssertionError, match="repeats"):
        write_tool_call_model(tmp_path / "model", call)
