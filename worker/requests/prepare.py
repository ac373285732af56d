"""A request made ready for the engine: the one hand-off value (`Prepared`) from request preparation
to the loop, built by `prepare` when a job is taken (or once a continue / fork job's stored
conversation is read). Raises JobRejected / PromptError for a request this model can never run."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

from engine.core.params import SamplingParams
from producer.models import GenerationRequest
from worker.requests.output_split import (
    OutputSplitter,
    refuse_grammar_in_reasoning,
    splitter_for,
    stop_after_one_call,
)
from worker.requests.prompts import prompt_tokens
from worker.requests.sampling import checked_sampling
from worker.requests.tool_grammar import forced_tool_calls


class Model(Protocol):
    """What preparing a request needs from the engine."""

    tokenizer: Any
    max_context: int

    def check(self, params: SamplingParams) -> None: ...


@dataclass(frozen=True)
class Prepared:
    prompt_tokens: list[int]
    output: OutputSplitter | None  # splits reasoning and tool calls from the answer; None: nothing to split
    sampling: SamplingParams  # checked against the model, ended after one tool call where asked


def prepare(model: Model, request: GenerationRequest) -> Prepared:
    """The request's prompt tokens, answer splitter and checked sampling (JobRejected / PromptError)."""
    tokenizer = model.tokenizer
    tokens = prompt_tokens(tokenizer, request)
    output = splitter_for(tokenizer, request, tokens)
    forced = forced_tool_calls(tokenizer, request, output)
    sampling = _fitted(model, checked_sampling(request, model.check, forced), request, len(tokens))
    refuse_grammar_in_reasoning(sampling, output)
    return Prepared(tokens, output, stop_after_one_call(sampling, output, request))


def _fitted(
    model: Model, sampling: SamplingParams, request: GenerationRequest, n_prompt: int
) -> SamplingParams:
    """With max_tokens_fit, max_tokens cut to what the context leaves after a prompt that fits (one
    that alone fills the context is still refused, with both numbers, at admission)."""
    room = model.max_context - n_prompt
    if not request.max_tokens_fit or room <= 0 or sampling.max_tokens <= room:
        return sampling
    return dataclasses.replace(sampling, max_tokens=room)
