"""The rq job function `worker.jobs.generate` and the checks a job payload passes before it runs.

A kvrq worker never calls `generate`: it reads the job's arguments and batches the request
into its engine. The function exists so rq records a real, importable path for the job,
and so a stock `rq worker` that picks one up fails it with an explanation.

Payload forms a worker accepts (rq JSON serializer):
    queue.enqueue("worker.jobs.generate", {"prompt": "..."})            # documented form
    queue.enqueue("worker.jobs.generate", request={"prompt": "..."})
    queue.enqueue("worker.jobs.generate", prompt="...", max_tokens=8)   # fields as kwargs
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError
from rq.exceptions import DeserializationError
from rq.job import Job

from engine.core.errors import InvalidRequestError
from engine.core.params import OutputGrammar, SamplingParams
from producer.models import QUEUE_OPTION_FIELDS, GenerationRequest, JsonObjectFormat, JsonSchemaFormat
from producer.wire.protocol import JOB_FUNCTION
from worker.job_data import BoundedJob


class JobRejected(Exception):
    """This job can never run (bad payload, other function, pickled data): fail it, do not retry."""


def generate(*args: Any, **kwargs: Any) -> dict[str, Any]:
    raise RuntimeError(
        "kvrq jobs are run by `kvrq worker`, which batches them into one model; "
        "a plain `rq worker` cannot run them. Start `kvrq worker --queue <this queue>`."
    )


def request_from_job(job: Job) -> GenerationRequest:
    """Validate the job's payload as a GenerationRequest, or raise JobRejected with a one-line reason."""
    if isinstance(job, BoundedJob) and job.data_problem is not None:
        raise JobRejected(job.data_problem)
    try:
        func_name, args, kwargs = job.func_name, job.args, job.kwargs
    except DeserializationError:
        raise JobRejected(
            "the job payload is not JSON: enqueue kvrq jobs with serializer=JSONSerializer "
            "(rq.serializers, alias 'json'); kvrq never unpickles job data"
        ) from None
    if func_name != JOB_FUNCTION:
        raise JobRejected(f"this queue runs {JOB_FUNCTION} jobs only, not {func_name}")
    payload = _payload(list(args), dict(kwargs))
    if isinstance(payload, dict) and (options := sorted(QUEUE_OPTION_FIELDS & payload.keys())):
        raise JobRejected(
            f"{', '.join(options)}: rq options, not request fields; the job runs on the queue it was "
            "enqueued to: pass job_timeout=, result_ttl=, retry=Retry(max=N), at_front= to rq's enqueue"
        )
    try:
        return GenerationRequest.model_validate(payload)
    except ValidationError as exc:
        raise JobRejected(f"invalid request: {validation_message(exc)}") from None


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


def _payload(args: list[Any], kwargs: dict[str, Any]) -> Any:
    if args and kwargs:
        raise JobRejected("pass the request as one positional dict or as keyword arguments, not both")
    if len(args) > 1:
        raise JobRejected(f"expected one positional argument (the request dict), got {len(args)}")
    if args:
        return args[0]
    if set(kwargs) == {"request"}:
        return kwargs["request"]
    if not kwargs:
        raise JobRejected("the job has no request: enqueue it with the request dict as its argument")
    return kwargs


def validation_message(exc: ValidationError, limit: int = 3) -> str:
    """pydantic's errors on one line: `field: message; ...`."""
    parts = []
    for error in exc.errors()[:limit]:
        where = ".".join(str(part) for part in error.get("loc", ())) or "request"
        parts.append(f"{where}: {error.get('msg', 'invalid')}")
    more = len(exc.errors()) - limit
    if more > 0:
        parts.append(f"and {more} more")
    return "; ".join(parts)
