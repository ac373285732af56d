"""Intake: a dequeued rq job becomes a HeldJob (validated, prepared: worker/requests/prepare.py,
started in rq, in its agent's line), or a `Rejected` value the loop hands to the endings; nothing
here ends a job itself."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from rq.job import Job, JobStatus
from rq.queue import Queue

from producer.models import GenerationRequest
from producer.wire.protocol import ERROR_META_KEY, FIRST_ENQUEUED_META_KEY, cancel_key
from worker.jobs import rqexec
from worker.jobs.payload import JobRejected, request_from_job
from worker.loop.endings import Rejected
from worker.loop.held import HeldJob
from worker.loop.parts import LoopParts
from worker.loop.timeline import mark
from worker.requests.prepare import Prepared, prepare
from worker.requests.prompts import PromptError
from worker.requests.sampling import sampling_of

if TYPE_CHECKING:
    pass


class Intake:
    def __init__(self, parts: LoopParts, *, idle_wait_s: int) -> None:
        self.parts = parts
        self.idle_wait_s = idle_wait_s  # 0: never block on an empty queue (tests)

    def next_job(self, block: bool) -> tuple[Job, Queue] | None:
        """The next job of this worker's queues (blocking up to `idle_wait_s` when `block`), or one
        another worker leaves waiting (affinity)."""
        return (
            self._dequeue_from(self.parts.worker.queues, self.idle_wait_s if block else None) or self.steal()
        )

    def steal(self) -> tuple[Job, Queue] | None:
        """With nothing in its own queues, take an affine job another worker leaves waiting."""
        for queue in self.parts.affinity.waiting_elsewhere():
            dequeued = self._dequeue_from([queue])
            if dequeued is not None:
                return dequeued
        return None

    def _dequeue_from(self, queues: list[Queue], timeout: int | None = None) -> tuple[Job, Queue] | None:
        return rqexec.dequeue(self.parts.worker, queues, timeout)

    def take(self, job: Job, queue: Queue) -> HeldJob | Rejected | None:
        """A dequeued job: None if canceled meanwhile (let go), Rejected if invalid, held otherwise."""
        dequeued = time.time()
        if job.get_status(refresh=False) == JobStatus.CANCELED:
            rqexec.forget_dequeued(job, queue)
            return None
        try:
            request = request_from_job(job)
            if request.extends_conversation:  # its prompt waits for the stored conversation (admission)
                prepared = Prepared([], None, sampling_of(request))
            else:
                prepared = prepare(self.parts.engine, request)
        except (JobRejected, PromptError) as exc:
            return Rejected(job, queue, f"{type(exc).__name__}: {exc}")
        return self._hold(job, queue, request, prepared, dequeued)

    def _hold(
        self,
        job: Job,
        queue: Queue,
        request: GenerationRequest,
        prepared: Prepared,
        dequeued: float,
    ) -> HeldJob:
        """Mark a valid job started, stand it in its agent's line and queue it for admission."""
        enqueued = job.enqueued_at.timestamp() if job.enqueued_at else time.time()
        first = _first_enqueued(job, enqueued)
        job.meta.pop(ERROR_META_KEY, None)  # a job re-queued from the failed registry starts clean
        execution = rqexec.start_job(self.parts.worker, job, queue)
        held = HeldJob(
            job=job,
            queue=queue,
            execution=execution,
            request=request,
            sampling=prepared.sampling,
            prompt_tokens=prepared.prompt_tokens,
            output=prepared.output,
            enqueued_at=enqueued,
            first_enqueued_at=first,
            held_at=time.monotonic(),
            extending=request.extends_conversation,
        )
        self.parts.scheduler.add(held)  # held from here on: an outage below cannot orphan it
        if request.agent_id is not None:
            self.parts.turns.join(request.agent_id, job.id, first)
        held.cancel_requested = bool(self.parts.connection.exists(cancel_key(job.id)))
        self.parts.publisher.start(job.id, execution.id)
        self.parts.publisher.progress(
            job, phase="waiting", worker=self.parts.worker.name, prompt_tokens=len(prepared.prompt_tokens)
        )
        held.timeline.update(enqueued=enqueued, dequeued=dequeued, dequeued_step=self.parts.clock.count)
        mark(held, "held", self.parts.clock.count)
        if (
            prepared.prompt_tokens
        ):  # its KV buffers, made while it waits for its turn and cache (engine.reserve)
            self.parts.engine.reserve(len(prepared.prompt_tokens), prepared.sampling.max_tokens)
        return held


def _first_enqueued(job: Job, enqueued: float) -> float:
    """The job's first enqueue time, kept in its meta across re-runs (junk there is replaced)."""
    first = job.meta.get(FIRST_ENQUEUED_META_KEY)
    if isinstance(first, bool) or not isinstance(first, int | float) or not 0 < first <= enqueued:
        first = job.meta[FIRST_ENQUEUED_META_KEY] = enqueued
    return float(first)
