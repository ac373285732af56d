"""HeldJob: one rq job this worker has started, from dequeue until it ends (finished, failed,
canceled, handed back or taken over elsewhere)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from rq.executions import Execution
from rq.job import Job
from rq.queue import Queue

from engine.core.params import SamplingParams
from producer.models import GenerationRequest

if TYPE_CHECKING:
    from engine.core.blocks import AgentCache
    from worker.requests.output_split import OutputSplitter

#: Where a held job is inside this worker. "waiting": held, not yet in the engine (for a slot,
#: KV blocks, its agent's turn or its cache); "running": in the engine; "ending": its outcome
#: is decided and being written (retried across Redis outages).
Phase = Literal["waiting", "running", "ending"]


@dataclass
class HeldJob:
    job: Job
    queue: Queue
    execution: Execution
    request: GenerationRequest
    sampling: SamplingParams
    prompt_tokens: list[int]
    enqueued_at: float  # unix time rq enqueued this run of the job
    first_enqueued_at: float  # unix time of its first enqueue: the agent's order, kept across re-runs
    held_at: float  # monotonic
    phase: Phase = "waiting"
    uid: int | None = None
    fence: int | None = None  # the agent's fencing token while this job holds its turn
    cache: Future[AgentCache | None] | None = None  # the agent's cache, read off the step thread
    admitted_at: float | None = None  # unix time
    admitted_mono: float | None = None
    cache_load_s: float = 0.0  # store time left on the critical path at admission (~0: prefetched)
    cache_hit: bool | None = None  # an agent's job entered the engine with (True) or without its saved cache
    generated: int = 0
    #: The answer ended with the call this many tokens in (a repeated call): a drafted step may have
    #: written past it, and those tokens are not the answer's.
    answer_tokens: int | None = None
    progress_at: float = 0.0  # monotonic time of the last progress write
    cancel_requested: bool = False
    stop_requested: bool = False  # rq's stop-job command, without the producer's cancel flag
    wait_reason: str = ""
    end_steps: set[str] = field(default_factory=set)  # ending steps already done (retried after outages)
    output: OutputSplitter | None = (
        None  # splits reasoning and tool calls from the answer; None: nothing to split
    )
    #: A continue / fork job whose prompt waits for its stored conversation
    #: (worker/requests/stored_conversations.py); `source` reads the cache that conversation came with.
    extending: bool = False
    source: Future[AgentCache | None] | None = None
    stored_messages: int = 0  # of request.messages, those the stored conversation gave (the rest: the job's)
    result: dict[str, Any] | None = None  # the finished job's result, built once
    local_prefix: AgentCache | None = None  # an agent-less job's match in this worker's recent caches
    #: Where the job's time to its first token went: unix times and the worker's engine step count at
    #: each milestone (worker/loop/timeline.py), published with its first token's progress write.
    timeline: dict[str, float] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return self.job.id

    @property
    def agent_id(self) -> str | None:
        return self.request.agent_id

    def namespace(self, worker_namespace: str) -> str | None:
        """The tenant of the job's reuse: the worker's, narrowed by the job's own field (never wider)."""
        own = self.request.namespace
        return None if own is None else f"{worker_namespace}/{own}"

    def tenant(self, worker_namespace: str) -> str:
        """The job's namespace in full (the worker's, narrowed by the job's own)."""
        return self.namespace(worker_namespace) or worker_namespace

    @property
    def timeout_s(self) -> float | None:
        timeout = self.job.timeout
        return float(timeout) if timeout is not None and timeout > 0 else None
