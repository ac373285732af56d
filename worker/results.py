"""Build a job's GenerationResult (its rq return value) from the engine's Completion."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from producer.models import GenerationResult, Timings, Usage
from worker.held import HeldJob

if TYPE_CHECKING:
    from engine.core.results import Completion


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


def build_result(held: HeldJob, completion: Completion, *, model: str, worker: str) -> dict[str, Any]:
    result = GenerationResult(
        job_id=held.id,
        agent_id=held.agent_id,
        text=completion.text,
        token_ids=list(completion.token_ids),
        finish_reason=completion.finish_reason,
        usage=Usage(**asdict(completion.usage)),
        timings=timings(held, completion, time.time()),
        metadata=held.request.metadata,
        model=model,
        worker=worker,
    )
    return result.model_dump(mode="json")
