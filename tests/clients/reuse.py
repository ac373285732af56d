"""Issue 42 item 6, measured: how much of what a request shares with an earlier one it resumed.

Each finished job's request is tokenized again exactly as the worker did (worker.requests.prompts), so
"shared" is the longest common token prefix with any earlier request of the session (its prompt and
the answer's tokens: both are in the KV it left), and "reused"
is the worker's own figure (its usage). The benchmark prints the same rows.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from engine.core.blocks import common_prefix_length
from tests.clients.stack import FinishedJob
from worker.requests.prompts import prompt_tokens

#: Of the tokens a request shares with an earlier one, the part it must resume (issue 42 item 6).
MIN_RESUMED = 0.95


@dataclass(frozen=True)
class Turn:
    """One request of a session: its prompt, what it shares with an earlier one, what it resumed."""

    prompt_tokens: int
    shared_tokens: int
    reused_tokens: int
    first_token_s: float | None
    agent_id: str | None

    @property
    def resumed_enough(self) -> bool:
        return self.reused_tokens >= MIN_RESUMED * self.shared_tokens


@functools.cache
def tokenizer_of(model: str) -> Any:
    """The tokenizer the worker renders prompts with (loading a model once per test session)."""
    from engine.models.load import load_model

    return load_model(model)[1]


def session_turns(jobs: list[FinishedJob], model: str) -> list[Turn]:
    """Per job, oldest first: prompt, tokens shared with an earlier job's prompt, tokens reused."""
    tokenizer = tokenizer_of(model)
    seen: list[list[int]] = []
    turns = []
    for job in jobs:
        tokens = prompt_tokens(tokenizer, job.request)
        shared = max((common_prefix_length(tokens, earlier) for earlier in seen), default=0)
        seen.append(tokens + list(job.result.token_ids))  # its answer is in the KV it left too
        usage = job.result.usage
        assert usage.prompt_tokens == len(tokens), "the prompt was rendered differently from the worker"
        turns.append(
            Turn(
                len(tokens),
                shared,
                usage.reused_tokens,
                job.result.timings.time_to_first_token_s,
                job.result.agent_id,
            )
        )
    return turns


def table(turns: list[Turn]) -> str:
    """The turns as lines a failing assertion (or the benchmark) prints."""
    lines = ["turn  prompt  shared  reused  first token s  agent"]
    for number, turn in enumerate(turns, 1):
        first = "-" if turn.first_token_s is None else f"{turn.first_token_s:.2f}"
        lines.append(
            f"{number:>4}  {turn.prompt_tokens:>6}  {turn.shared_tokens:>6}  {turn.reused_tokens:>6}  "
            f"{first:>13}  {turn.agent_id}"
        )
    return "\n".join(lines)
