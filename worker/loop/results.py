"""Build a job's GenerationResult (its rq return value) from the engine's Completion, and its
figures for the latency histograms."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from producer.models import FinishReason, GenerationResult, Timings, Usage
from worker.fleet.latency import CacheLabel, Observations
from worker.loop.held import HeldJob
from worker.requests.logprobs import LogprobFormatter
from worker.requests.schema_check import schema_check

if TYPE_CHECKING:
    from engine.core.results import Completion
    from worker.requests.output_split import OutputSplitter


def timings(held: HeldJob, completion: Completion | None, ended: float) -> Timings:
    """Seconds from the job's enqueue (rq's `enqueued_at`) to each milestone; `ended` is unix time."""
    start = held.enqueued_at
    admitted = held.admitted_at if held.admitted_at is not None else ended
    # The engine's own measure: submit() accepted the sequence .. step() returned its first token.
    engine_ttft = None if completion is None else completion.time_to_first_token_s
    return Timings(
        queued_s=max(0.0, admitted - start),
        time_to_first_token_s=None if engine_ttft is None else max(0.0, admitted - start) + engine_ttft,
        total_s=max(0.0, ended - start),
        cache_load_s=held.cache_load_s,
        engine_time_to_first_token_s=engine_ttft,
    )


def answer_finish_reason(split: OutputSplitter | None, engine_reason: FinishReason) -> FinishReason:
    """The finish reason a client sees: "tool_calls" where the row stopped after its tool calls."""
    if split is not None and split.tool_calls and engine_reason == "stop":
        return "tool_calls"
    return engine_reason


def build_result(
    held: HeldJob, completion: Completion, *, model: str, worker: str, logprobs: LogprobFormatter
) -> dict[str, Any]:
    """The job's result; with an output splitter, the answer apart from its reasoning and tool calls
    (a row that ended with a tool call and nothing else to say finishes with "tool_calls"); a
    response_format answer checked against its whole schema (`schema_check`, the finish reason unchanged)."""
    split = held.output
    finish_reason = answer_finish_reason(split, completion.finish_reason)
    text = completion.text if split is None else split.text
    result = GenerationResult(
        job_id=held.id,
        agent_id=held.agent_id,
        text=text,
        token_ids=list(completion.token_ids),
        finish_reason=finish_reason,
        tool_calls=None if split is None else split.tool_calls or None,
        reasoning=None if split is None else split.reasoning or None,
        logprobs=None
        if completion.logprobs is None
        else [
            logprobs(token, lp) for token, lp in zip(completion.token_ids, completion.logprobs, strict=False)
        ],
        usage=Usage(**asdict(completion.usage)),
        timings=timings(held, completion, time.time()),
        metadata=held.request.metadata,
        model=model,
        worker=worker,
        schema_check=schema_check(held.sampling.grammar, text),
    )
    return result.model_dump(mode="json")


def job_observations(held: HeldJob, completion: Completion | None, ended: float) -> Observations:
    """One ended job's values (None where it never got there: no first token, never admitted)."""
    times = timings(held, completion, ended)
    admitted = held.admitted_at is not None
    generated = len(completion.token_ids) if completion is not None else held.generated
    in_engine = ended - held.admitted_at if held.admitted_at is not None else 0.0
    return {
        "queue_wait": times.queued_s if admitted else None,
        "cache_load": times.cache_load_s if held.cache_hit is not None else None,  # an agent, a store
        "first_token": times.time_to_first_token_s,
        "total": times.total_s,
        "tokens_per_second": generated / in_engine if generated and in_engine > 0 else None,
    }


def cache_label(held: HeldJob) -> CacheLabel:
    """The histograms' `cache` label of an ended job (worker/fleet/latency.py)."""
    if held.cache_hit is None:
        return "none"
    return "hit" if held.cache_hit else "miss"
