"""The one ending path: how a held job's outcome is decided (`end`) and written (`flush`).

`end` takes the job out of the scheduler and the engine at once; `flush` writes each decided ending,
step by step (cache, stream, rq, agent turn), each step once even when a Redis outage interrupts
them, and again where a failover dropped them (worker/fleet/confirmed_endings.py). Every phase of the loop
returns its endings as values; only the loop hands them here.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from rq.job import Job
from rq.queue import Queue

from producer.wire.protocol import ERROR_META_KEY, ErrorCode
from worker.fleet.confirmed_endings import ConfirmedEndings
from worker.fleet.latency import LatencyHistograms
from worker.jobs import rqexec
from worker.loop.durability import Durability
from worker.loop.held import HeldJob
from worker.loop.outcomes import Canceled, Ending, Failed, Finished, HandedBack, Outcome, Stopped, TakenOver
from worker.loop.parts import LoopParts
from worker.loop.results import answer_finish_reason, build_result, cache_label, job_observations
from worker.requests import stored_conversations

if TYPE_CHECKING:
    from engine.core.blocks import AgentCache

log = logging.getLogger("kvrq.worker")


@dataclasses.dataclass(frozen=True)
class Rejected:
    """A dequeued job that can never run (bad payload): failed at once, never held."""

    job: Job
    queue: Queue
    reason: str


class Endings:
    def __init__(self, parts: LoopParts) -> None:
        self.parts = parts
        self.latency = LatencyHistograms()
        self.queue: deque[Ending] = deque()  # decided, not yet written
        self.confirmed = ConfirmedEndings(self.parts.connection)  # kept until a replica holds them
        self.durability = Durability(parts.turns, parts.counts)

    def end(self, held: HeldJob, outcome: Outcome) -> None:
        """Decide how `held` ends: out of the scheduler and the engine now, written by `flush`."""
        if isinstance(outcome, Failed) and outcome.retry and not held.job.should_retry:
            outcome = Failed(outcome.code, outcome.reason, retry=False)  # retry now means: rq will re-run it
        self.parts.scheduler.remove(held)
        if held.uid is not None and not isinstance(outcome, Finished):
            try:
                self.parts.engine.cancel(held.uid)  # frees its blocks; a no-op for a finished sequence
            except Exception:
                log.exception("engine.cancel(%d) failed for job %s", held.uid, held.id)
        held.phase = "ending"
        self.queue.append((held, outcome))

    def end_all(self, endings: Iterable[Ending]) -> None:
        """End each of `endings` as it comes (a phase's lazy iterator sees the ones before ended)."""
        for held, outcome in endings:
            self.end(held, outcome)

    def flush(self) -> None:
        """Publish buffered writes, then each decided ending; an outage leaves the rest for next time."""
        self.parts.publisher.flush()
        while self.queue:
            held, outcome = self.queue[0]
            written = self.write(held, outcome)
            self.queue.popleft()
            self.confirmed.written(held, written)
        for lost in self.confirmed.lost():
            # The failover dropped these writes: once more, on the new primary (only those it dropped).
            lost.held.end_steps -= lost.steps
            self.parts.counts["endings_rewritten"] += 1
            self.queue.append((lost.held, lost.outcome))
        self.parts.counts["releases_rewritten"] += self.parts.turns.confirm_releases()

    def write(self, held: HeldJob, outcome: Outcome) -> Outcome:
        """Cache, stream, rq, agent turn: each step once, even when an outage interrupts them. Returns
        the outcome written (TakenOver where the job turned out to be no longer ours)."""
        steps = held.end_steps
        if "cache" not in steps:
            self._save_cache(held, outcome)
            self.parts.scheduler.agent_done(held)  # its cache is in the store: the agent's next job may start
            steps.add("cache")
        if "stream" not in steps:
            # Where rq's ending stands (a failover dropped only the closing), the run is ours: no check.
            if (
                isinstance(outcome, Finished)
                and "rq" not in steps
                and not rqexec.owns_execution(self.parts.connection, held.job, held.execution)
            ):
                outcome = TakenOver(None)  # re-run elsewhere meanwhile: its stream and result are that run's
            self._publish(held.job, outcome, held)
            steps.add("stream")
        if "rq" not in steps:
            if not self._record_in_rq(held.job, held.queue, held.execution, outcome, held):
                outcome = TakenOver(None)
            steps.add("rq")
        if "turn" not in steps:
            self._end_turn(held, outcome)
            steps.add("turn")
        if "counted" in steps:
            return outcome  # written again after a failover: counted and logged the first time
        steps.add("counted")
        self.parts.counts[_counter(outcome)] += 1
        if not isinstance(outcome, HandedBack | TakenOver):  # those runs go on elsewhere
            completion = outcome.completion if isinstance(outcome, Finished) else None
            observed = job_observations(held, completion, time.time())
            self.latency.observe(observed, outcome=outcome.phase, cache=cache_label(held))
        if isinstance(outcome, Finished):
            self.parts.counts["prompt_tokens"] += outcome.completion.usage.prompt_tokens
            self.parts.counts["reused_tokens"] += outcome.completion.usage.reused_tokens
        _log_ending(held, outcome)
        return outcome

    def reject(self, rejected: Rejected) -> None:
        """Fail an invalid job at once (no retry: it would fail the same way), recorded as an execution."""
        job, queue = rejected.job, rejected.queue
        log.warning("job %s rejected: %s", job.id, rejected.reason)
        execution = rqexec.start_rejected(self.parts.worker, job, queue)
        outcome = Failed(ErrorCode.INVALID_REQUEST, rejected.reason, retry=False)
        self._publish(job, outcome)
        self._record_in_rq(job, queue, execution, outcome)
        self.parts.counts["failed"] += 1

    def _save_cache(self, held: HeldJob, outcome: Outcome) -> None:
        if not isinstance(outcome, Finished):
            return
        if held.agent_id is None:
            self._save_prefix(held, outcome.completion.cache)
            return
        result = self._result(held, outcome)
        own = len(held.request.messages or ()) - held.stored_messages
        conversation = stored_conversations.record(
            self.parts.connection, held.request, own, result, held.fence
        )
        cache = outcome.completion.cache
        if cache is None or self.parts.store is None:
            return
        if self.parts.recent is not None:
            # A new agent of the namespace that re-sends this history (a Responses turn without
            # previous_response_id, a client that rotates its session id) resumes from it to the token.
            self.parts.recent.add(cache, held.tenant(self.parts.settings.namespace))
        try:
            cache = dataclasses.replace(cache, conversation=conversation)
            namespace = held.namespace(self.parts.settings.namespace)
            put = self.parts.store.put(held.agent_id, cache, fence=held.fence, namespace=namespace)
            self.durability.track(held, put)
            if self.parts.settings.store_hot_mb > 0:
                self.parts.affinity.record_home(held.agent_id)
        except Exception:
            # The answer is good; only the next turn's warm start is lost.
            log.exception("job %s: saving agent %s's cache failed", held.id, held.agent_id)
            self.parts.counts["cache_put_failed"] += 1

    def _save_prefix(self, held: HeldJob, cache: AgentCache | None) -> None:
        """Keep a finished agent-less job's full blocks for the next job with the same prefix (best
        effort: the write happens behind, and a failure only costs a later job its reuse)."""
        if cache is None:
            return
        if self.parts.recent is not None:
            self.parts.recent.add(cache, held.tenant(self.parts.settings.namespace))
        if self.parts.store is None or not self.parts.prefix_reuse:
            return
        try:
            self.parts.store.put_prefix(cache, namespace=held.namespace(self.parts.settings.namespace))
        except Exception:
            log.exception("job %s: keeping its prefix for reuse failed", held.id)

    def _publish(self, job: Job, outcome: Outcome, held: HeldJob | None = None) -> None:
        """The stream's last event and the job's final progress phase."""
        progress: dict[str, Any] = {"phase": outcome.phase}
        if isinstance(outcome, Finished):
            output = None if held is None else held.output
            reason = answer_finish_reason(output, outcome.completion.finish_reason)
            self.parts.publisher.end(job.id, reason, usage=dataclasses.asdict(outcome.completion.usage))
            progress["generated_tokens"] = len(outcome.completion.token_ids)
        elif isinstance(outcome, Failed) and not outcome.retry:
            job.meta[ERROR_META_KEY] = {"code": outcome.code, "message": outcome.message}
            self.parts.publisher.error(job.id, outcome.message, code=outcome.code)
        elif isinstance(outcome, Canceled):
            self.parts.publisher.end(job.id, "canceled")
        elif isinstance(outcome, Stopped):
            self.parts.publisher.error(job.id, "stopped by rq's stop-job command")
        if not isinstance(outcome, TakenOver):
            self.parts.publisher.progress(job, **progress)
        self.parts.publisher.flush()

    def _record_in_rq(
        self,
        job: Job,
        queue: Queue,
        execution: rqexec.Execution,
        outcome: Outcome,
        held: HeldJob | None = None,
    ) -> bool:
        """The rq side of an ending; False when the job turned out to be no longer ours."""
        if isinstance(outcome, Finished):
            assert held is not None
            return rqexec.finish_job(self.parts.worker, job, queue, execution, self._result(held, outcome))
        if isinstance(outcome, Failed):
            rqexec.fail_job(
                self.parts.worker,
                job,
                queue,
                execution,
                outcome.reason,
                retry=outcome.retry,
                code=outcome.code,
                message=outcome.message,
            )
        elif isinstance(outcome, Canceled):
            rqexec.cancel_job(self.parts.worker, job, queue, execution)
        elif isinstance(outcome, Stopped):
            rqexec.stop_job(self.parts.worker, job, queue, execution)
        elif isinstance(outcome, HandedBack):
            rqexec.requeue_job(self.parts.worker, job, queue, execution, at_front=True)
        else:
            rqexec.drop_execution(self.parts.worker, job, execution)
        return True

    def _result(self, held: HeldJob, outcome: Finished) -> dict[str, Any]:
        """The job's result, built once (the conversation record and rq both use it)."""
        if held.result is None:
            held.result = build_result(
                held,
                outcome.completion,
                model=self.parts.model_name,
                worker=self.parts.worker.name,
                logprobs=self.parts.logprob_format,
            )
        return held.result

    def _end_turn(self, held: HeldJob, outcome: Outcome) -> None:
        """Leave the agent's line unless the job runs again; free its lock unless its put is pending."""
        agent = held.agent_id
        if agent is None:
            return
        runs_again = isinstance(outcome, HandedBack | TakenOver) or (
            isinstance(outcome, Failed) and outcome.retry
        )
        if not runs_again:
            self.parts.turns.leave(agent, held.id)
        self.durability.release()
        if not self.durability.pending(held):
            self.parts.turns.release(agent, held.id)


def _counter(outcome: Outcome) -> str:
    return "dropped" if isinstance(outcome, TakenOver) else outcome.phase


def _log_ending(held: HeldJob, outcome: Outcome) -> None:
    if isinstance(outcome, Finished):
        c = outcome.completion
        log.info(
            "job %s (agent %s) %s: %d tokens, %d of %d prompt tokens reused",
            held.id,
            held.agent_id,
            c.finish_reason,
            len(c.token_ids),
            c.usage.reused_tokens,
            c.usage.prompt_tokens,
        )
    elif isinstance(outcome, Failed):
        retry = " (will retry)" if outcome.retry else ""
        log.warning("job %s failed%s [%s]: %s", held.id, retry, outcome.code, outcome.reason.strip())
    elif isinstance(outcome, TakenOver):
        log.warning("job %s is %s now, no longer ours: dropped it", held.id, outcome.status)
    else:
        log.info("job %s %s", held.id, outcome.phase)
