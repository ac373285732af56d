"""A request's generation options as the engine takes them (SamplingParams), checked against the model."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable

from engine.core.errors import InvalidRequestError
from engine.core.params import OutputGrammar, SamplingParams
from producer.models import GenerationRequest, JsonObjectFormat, JsonSchemaFormat
from worker.jobs.payload import JobRejected


def sampling_of(request: GenerationRequest) -> SamplingParams:
    """The request's generation options as the engine takes them."""
    return SamplingParams(
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        seed=request.seed,
        stop=tuple(request.stop),
        top_k=request.top_k,
        min_p=request.min_p,
        repetition_penalty=request.repetition_penalty,
        repetition_context_size=request.repetition_context_size,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        logit_bias=tuple(sorted(request.logit_bias_ids.items())),
        logprobs=request.logprobs,
        top_logprobs=request.top_logprobs or 0,
        grammar=output_grammar(request),
    )


def output_grammar(request: GenerationRequest) -> OutputGrammar | None:
    """response_format as the grammar the answer is held to (json_object: any JSON object)."""
    response_format = request.response_format
    if isinstance(response_format, JsonObjectFormat):
        return OutputGrammar("json_schema", '{"type": "object"}', "response_format json_object")
    if isinstance(response_format, JsonSchemaFormat):
        spec = response_format.json_schema
        source = json.dumps(spec.json_schema, sort_keys=True, separators=(",", ":"))
        return OutputGrammar("json_schema", source, f"response_format schema {spec.name!r}")
    return None


def checked_sampling(
    request: GenerationRequest,
    check: Callable[[SamplingParams], None],
    tool_grammar: OutputGrammar | None = None,
) -> SamplingParams:
    """sampling_of(request) (with `tool_grammar`, the forced tool calls, as its grammar), checked against
    the model by `check` (the engine's: a logit_bias id past its vocabulary, a grammar its library cannot
    enforce), or JobRejected: refused when the job is taken, before it waits for a batch slot."""
    if output_grammar(request) is not None and request.tools and request.tool_choice in (None, "auto"):
        raise JobRejected(
            "invalid request: response_format json_object / json_schema holds the whole answer to JSON, "
            "so the tools offered could never be called: send tool_choice 'none' or leave response_format out"
        )
    sampling = sampling_of(request)
    if tool_grammar is not None:
        sampling = dataclasses.replace(sampling, grammar=tool_grammar)
    try:
        check(sampling)
    except InvalidRequestError as exc:
        raise JobRejected(f"invalid request: {exc}") from None
    return sampling
