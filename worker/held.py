"""HeldJob: one rq job this worker has started, from dequeue until it is finished, failed or handed back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rq.executions import Execution
from rq.job import Job
from rq.queue import Queue

from producer.models import GenerationRequest

Phase = Literal["waiting", "running", "finishing"]


@dataclass
class HeldJob:
    job: Job
    queue: Queue
    execution: Execution
    request: GenerationRequest
    prompt_tokens: list[int]
    enqueued_at: float  # unix time (rq's enqueued_at)
    held_at: float  # monotonic
    phase: Phase = "waiting"
    uid: int | None = None
    admitted_at: float | None = None  # unix time
    admitted_mono: float | None = None
    cache_load_s: float = 0.0
    first_token_at: float | None = None  # unix time
    generated: int = 0
    progress_at: float = 0.0  # monotonic time of the last progress write
    cancel_requested: bool = False
    wait_reason: str = ""
    finish_steps: set[str] = field(
        default_factory=set
    )  # completion steps already done (retried after outages)

    @property
    def id(self) -> str:
        return self.job.id

    @property
    def agent_id(self) -> str | None:
        return self.request.agent_id

    @property
    def timeout_s(self) -> float | None:
        timeout = self.job.timeout
        return float(timeout) if timeout is not None and timeout > 0 else None
