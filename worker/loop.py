"""The worker's one loop: rq jobs in, engine steps, token streams and results out.

Each iteration, in this order:
1. flush: publish the buffered stream/progress writes and write the endings decided so far;
2. commands: stop-job requests from rq's pubsub thread;
3. liveness: heartbeats of held jobs and agent locks; crash re-runs of dead workers' jobs
   (every `crash_check_interval`); rq's registry cleanup (every `maintenance_interval`);
   rq's scheduler (every `scheduler_interval`, worker/scheduled.py: why not a forked process);
4. release the agent turns whose cache put became durable;
5. cancels and job timeouts end jobs;
6. admission (the scheduler's policy, the engine's verdict) and intake (dequeue without
   blocking while there is room; block for a second only when idle); or, once a stop was
   requested, hand jobs back;
7. one `engine.step()`, then flush again.

Single-threaded on purpose: the engine, the store calls and every rq write happen here.
Other threads: rq's pubsub listener (hands stop commands over a queue), the liveness
beacon, and the store's own I/O threads (prefetch, write-behind), which the loop only polls.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import time
import traceback
import weakref
from collections import deque
from concurrent.futures import Future, wait
from queue import Empty
from types import FrameType
from typing import TYPE_CHECKING, Any

from rq.job import Job, JobStatus
from rq.queue import Queue

from engine.core.errors import CacheMismatchError, InvalidRequestError, PoolExhaustedError
from producer.models import GenerationRequest
from producer.wire.protocol import (
    CACHE_HITS_FIELD,
    CACHE_LOOKUPS_FIELD,
    CAPACITY_FIELD,
    CONTEXT_FIELD,
    ERROR_META_KEY,
    FIRST_ENQUEUED_META_KEY,
    FREE_BLOCKS_FIELD,
    HOT_AGENTS_FIELD,
    HOT_HITS_FIELD,
    LATENCY_FIELD,
    MAX_BATCH_FIELD,
    MEMORY_FIELD,
    MODEL_FIELD,
    POOL_BLOCKS_FIELD,
    PROMPT_TOKENS_FIELD,
    REUSED_TOKENS_FIELD,
    RUNNING_FIELD,
    WAITING_FIELD,
    ErrorCode,
    cancel_key,
)
from producer.wire.redis_url import REDIS_DOWN
from worker import conversations, rqexec
from worker.affinity import Affinity
from worker.agent_output import (
    OutputSplitter,
    Piece,
    refuse_grammar_in_reasoning,
    splitter_for,
    stop_after_one_call,
)
from worker.agent_turns import AgentTurns
from worker.backoff import Backoff
from worker.confirmed_endings import ConfirmedEndings
from worker.held import HeldJob
from worker.jobs import JobRejected, checked_sampling, request_from_job, sampling_of
from worker.latency import LatencyHistograms
from worker.liveness import LivenessBeacon
from worker.logprobs import LogprobFormatter
from worker.maintenance import clean_queues, rerun_crashed
from worker.memory import memory_field
from worker.outcomes import COUNTERS, Canceled, Failed, Finished, HandedBack, Outcome, Stopped, TakenOver
from worker.ports import Engine, Store
from worker.prompts import PromptError, prompt_tokens
from worker.publisher import Publisher
from worker.recent_prefixes import RecentPrefixes
from worker.results import answer_finish_reason, build_result, cache_label, job_observations
from worker.scheduled import ScheduledJobs
from worker.scheduler import Scheduler
from worker.settings import WorkerSettings
from worker.timeline import mark
from worker.tool_grammar import forced_tool_calls

if TYPE_CHECKING:
    from engine.core.blocks import AgentCache
    from engine.core.params import SamplingParams
    from engine.core.results import Completion, StepOutput

log = logging.getLogger("kvrq.worker")

#: A busy batch waits this share of its last step, once per read, for cache reads taken this pass.
READ_WAIT_FRACTION = 0.25


class WorkerLoop:
    def __init__(
        self,
        *,
        engine: Engine,
        store: Store | None,
        rq_worker: rqexec.KvrqWorker,
        settings: WorkerSettings,
        model_name: str,
        idle_wait_s: int = 1,
    ) -> None:
        self.engine = engine
        self.logprob_format = LogprobFormatter(engine.tokenizer)
        self.store = store
        self.worker = rq_worker
        self.settings = settings
        self.model_name = model_name
        self.idle_wait_s = idle_wait_s  # 0: never block on an empty queue (tests)
        self.connection = rq_worker.connection
        self.scheduler = Scheduler(settings.held_limit)
        self.publisher = Publisher(
            self.connection, stream_ttl=settings.stream_ttl, stream_maxlen=settings.stream_maxlen
        )
        self.turns = AgentTurns(self.connection, rq_worker.name, settings.heartbeat_ttl)
        self.beacon = LivenessBeacon(self.connection, rq_worker.name, settings.liveness_ttl)
        self.scheduled = ScheduledJobs(
            self.connection, [q.name for q in rq_worker.queues], rq_worker.name, settings.scheduler_interval
        )
        self.affinity = Affinity(
            self.connection, rq_worker, enabled=settings.affinity, wait_s=settings.affinity_wait
        )
        self.latency = LatencyHistograms()
        self.steps = 0  # engine steps run: the unit of a job's timeline (worker/timeline.py)
        self.step_started = 0.0  # unix time the latest step began
        self.step_cpu = (0.0, 0.0)  # CPU seconds (all threads) of the step before the latest, and the latest
        self.step_s = 0.0  # wall seconds of the latest step
        self.awaited: weakref.WeakSet[Future[Any]] = weakref.WeakSet()  # reads a step already waited for
        self.ending: deque[tuple[HeldJob, Outcome]] = deque()
        self.confirmed = ConfirmedEndings(self.connection)  # kept until a replica holds them
        self.saving: list[tuple[HeldJob, Future[bool]]] = []  # agent turns kept until the put is durable
        #: Jobs without an agent resume from (and feed) the shared prefixes of their namespace, and the
        #: whole caches recent ones left in this worker's memory (token-granular).
        self.prefix_reuse = store is not None and settings.prefix_cache_mb != 0
        recent_bytes = int(settings.recent_prefix_mb * 1024 * 1024)
        self.recent = RecentPrefixes(recent_bytes) if recent_bytes > 0 else None
        self.draining = False
        self.force_stop = False
        self.drain_deadline = 0.0
        self.backoff = Backoff()
        self.next_heartbeat = 0.0
        self.next_crash_check = 0.0
        self.next_maintenance = 0.0
        self.counts = dict.fromkeys(
            (
                *COUNTERS,
                "tokens",
                "prompt_tokens",
                "reused_tokens",
                "cache_read_failed",
                "crash_reruns",
                "cache_put_failed",
                "stale_puts",
                "endings_rewritten",  # dropped by a failover, written again (worker/confirmed_endings.py)
                "releases_rewritten",  # agent-turn releases a failover dropped, made again (agent_turns.py)
            ),
            0,
        )

    # ---- lifecycle ---------------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)

    def request_stop(self, signum: int = signal.SIGTERM, frame: FrameType | None = None) -> None:
        """First signal: drain (running jobs get drain_timeout to finish). Second: hand all back now."""
        if self.draining:
            self.force_stop = True
            log.warning("second stop signal: re-queueing running jobs now")
            return
        self.draining = True
        self.drain_deadline = time.monotonic() + self.settings.drain_timeout
        log.info(
            "stop requested (%s): no new jobs; %d running get %.0f s to finish",
            signal.Signals(signum).name,
            len(self.scheduler.running),
            self.settings.drain_timeout,
        )

    def start(self) -> None:
        """Register with rq and listen. Redis unavailable meanwhile (a failover's NOREPLICAS window, an
        outage) is waited out with backoff as in run(), each step done once: a worker started or
        restarted mid-failover must not exit. A stop requested meanwhile leaves the rest to run()."""
        done: set[str] = set()
        while not self.draining:
            try:
                self._register(done)
                break
            except REDIS_DOWN as exc:
                delay = self.backoff.next(exc)
                log.warning(
                    "Redis unavailable at start (%s): retry %d in %.1f s", exc, self.backoff.failures, delay
                )
                time.sleep(delay)
        self.backoff.reset()
        log.info(
            "worker %s listening on %s (max_batch %d, pool %d blocks)",
            self.worker.name,
            ", ".join(q.name for q in self.worker.queues),
            self.settings.max_batch,
            self.engine.pool.total_blocks,
        )

    def _register(self, done: set[str]) -> None:
        if "birth" not in done:
            retry = "birth tried" in done  # whether that try's MULTI ran is unknown: look first
            done.add("birth tried")
            if retry:
                rqexec.register_again(self.worker)
            else:
                self.worker.register_birth()
            done.add("birth")
        self.connection.hset(self.worker.key, mapping=self.worker_fields())  # type: ignore[arg-type]
        if "beacon" not in done:
            self.beacon.start()  # its first beat here; the thread's beats ride outages on their own
            done.add("beacon")
        if "subscribe" not in done:
            self.worker.subscribe()
            done.add("subscribe")
        self.worker.set_state("idle")

    def run(self) -> int:
        """Run until stopped and drained. Redis outages are waited out with backoff."""
        while True:
            try:
                if self.backoff.failures:
                    # Back from an outage: say "alive" before anything else. The liveness key may have
                    # expired meanwhile, and a job's ending written below could bring its client's
                    # next request (kvrq serve) before the beacon's next beat: "no live worker".
                    self.beacon.beat()
                if self.run_once():
                    break
                self.backoff.reset()
            except REDIS_DOWN as exc:
                if self.force_stop:
                    # Nothing can be handed back without Redis; the liveness key expires, so
                    # the other workers' crash check re-runs what is held here.
                    log.error(
                        "Redis unreachable during a forced stop (%s): leaving held jobs to the crash check",
                        exc,
                    )
                    break
                if self.draining and not self.scheduler and not self.ending:
                    # Stopping with nothing held and nothing left to write: Redis is not needed
                    # (its registrations expire). A stack stopped all at once (honcho, Ctrl-C)
                    # stops Redis first; waiting for it kept the worker up until SIGKILL.
                    log.warning("Redis unreachable while stopping with nothing held (%s): stopping", exc)
                    break
                delay = self.backoff.next(exc)
                # Every liveness key may have expired meanwhile: both checks that re-run dead workers'
                # jobs (the crash check, and maintenance's) wait until the peers have beaten again.
                peers_beat = time.monotonic() + delay + self.settings.liveness_ttl
                self.next_crash_check = peers_beat
                self.next_maintenance = max(self.next_maintenance, peers_beat)
                log.warning("Redis unreachable (%s): retry %d in %.1f s", exc, self.backoff.failures, delay)
                time.sleep(delay)
        self.shutdown()
        return 0

    def shutdown(self) -> None:
        if self.store is not None:
            try:
                self.store.close()  # flushes write-behind: the saving turns become durable
            except Exception:
                log.exception("store close failed: write-behind caches may be lost")
        try:
            self._release_saved_turns(force=True)
            self.scheduled.stop()  # another worker takes the scheduler locks at its next run
            self.worker.register_death()
            self.worker.unsubscribe()
        except REDIS_DOWN as exc:
            log.warning("could not unregister from Redis: %s", exc)
        self.beacon.stop()
        log.info("worker %s stopped: %s", self.worker.name, self.counts)

    # ---- one iteration -------------------------------------------------------------------

    def run_once(self) -> bool:
        """One pass of the loop; True once a stop was requested and nothing is held any more."""
        self._flush()
        self._take_commands()
        now = time.monotonic()
        if now >= self.next_heartbeat:
            self._heartbeat()
        if not self.draining and now >= self.next_crash_check:
            self._check_crashes()
        if not self.draining and now >= self.next_maintenance:
            self._maintenance()
        if self.scheduled.due(now):
            self.scheduled.run(now)  # while draining too: due jobs go to the queue for the others
        self._release_saved_turns()
        self._apply_cancels()
        self._enforce_timeouts()
        if self.draining:
            self._drain()
            self._flush()
            if not self.scheduler and not self.ending:
                return True
        else:
            self._admit()
            self._fill()
            self._await_reads()
        if self.engine.has_work():
            self._step()
            self._flush()
        rqexec.set_busy(self.worker, bool(self.scheduler))
        return False

    # ---- intake ------------------------------------------------------------------------

    def _fill(self) -> None:
        block = self.idle_wait_s > 0 and not self.engine.has_work() and not self.scheduler
        while self.scheduler.wants_more(self.engine.free_slots()):
            dequeued = self._dequeue(block) or self._steal()
            block = False
            if dequeued is None:
                return
            self._take(*dequeued)
            self._admit()

    def _steal(self) -> tuple[Job, Queue] | None:
        """With nothing in its own queues, take an affine job another worker leaves waiting."""
        for queue in self.affinity.waiting_elsewhere():
            dequeued = self._dequeue_from([queue])
            if dequeued is not None:
                return dequeued
        return None

    def _dequeue(self, block: bool) -> tuple[Job, Queue] | None:
        return self._dequeue_from(self.worker.queues, self.idle_wait_s if block else None)

    def _dequeue_from(self, queues: list[Queue], timeout: int | None = None) -> tuple[Job, Queue] | None:
        return rqexec.dequeue(self.worker, queues, timeout)

    def _take(self, job: Job, queue: Queue) -> None:
        """A dequeued job: dropped if canceled meanwhile, rejected if invalid, held otherwise."""
        dequeued = time.time()
        if job.get_status(refresh=False) == JobStatus.CANCELED:
            rqexec.forget_dequeued(job, queue)
            return
        try:
            request = request_from_job(job)
            if request.extends_conversation:  # its prompt waits for the stored conversation (_extend)
                self._hold(job, queue, request, sampling_of(request), [], None, dequeued)
                return
            tokens, output, sampling = self._prepare(request)
        except (JobRejected, PromptError) as exc:
            self._reject(job, queue, f"{type(exc).__name__}: {exc}")
            return
        self._hold(job, queue, request, sampling, tokens, output, dequeued)

    def _prepare(self, request: GenerationRequest) -> tuple[list[int], OutputSplitter | None, SamplingParams]:
        """The request's prompt tokens, answer splitter and checked sampling (JobRejected / PromptError)."""
        tokenizer = self.engine.tokenizer
        tokens = prompt_tokens(tokenizer, request)
        output = splitter_for(tokenizer, request, tokens)
        forced = forced_tool_calls(tokenizer, request, output)
        sampling = self._fitted(checked_sampling(request, self.engine.check, forced), request, len(tokens))
        refuse_grammar_in_reasoning(sampling, output)
        return tokens, output, sampling

    def _fitted(self, sampling: SamplingParams, request: GenerationRequest, n_prompt: int) -> SamplingParams:
        """With max_tokens_fit, max_tokens cut to what the context leaves after a prompt that fits (one
        that alone fills the context is still refused, with both numbers, at admission)."""
        room = self.engine.max_context - n_prompt
        if not request.max_tokens_fit or room <= 0 or sampling.max_tokens <= room:
            return sampling
        return dataclasses.replace(sampling, max_tokens=room)

    def _reject(self, job: Job, queue: Queue, reason: str) -> None:
        """Fail an invalid job at once (no retry: it would fail the same way), recorded as an execution."""
        log.warning("job %s rejected: %s", job.id, reason)
        execution = rqexec.start_rejected(self.worker, job, queue)
        outcome = Failed(ErrorCode.INVALID_REQUEST, reason, retry=False)
        self._publish_ending(job, outcome)
        self._record_in_rq(job, queue, execution, outcome)
        self.counts["failed"] += 1

    def _hold(
        self,
        job: Job,
        queue: Queue,
        request: GenerationRequest,
        sampling: SamplingParams,
        tokens: list[int],
        output: OutputSplitter | None,
        dequeued: float,
    ) -> None:
        """Mark a valid job started, stand it in its agent's line and queue it for admission."""
        enqueued = job.enqueued_at.timestamp() if job.enqueued_at else time.time()
        first = _first_enqueued(job, enqueued)
        job.meta.pop(ERROR_META_KEY, None)  # a job re-queued from the failed registry starts clean
        execution = rqexec.start_job(self.worker, job, queue)
        held = HeldJob(
            job=job,
            queue=queue,
            execution=execution,
            request=request,
            sampling=stop_after_one_call(sampling, output, request),
            prompt_tokens=tokens,
            output=output,
            enqueued_at=enqueued,
            first_enqueued_at=first,
            held_at=time.monotonic(),
            extending=request.extends_conversation,
        )
        self.scheduler.add(held)  # held from here on: an outage below cannot orphan it
        if held.agent_id is not None:
            self.turns.join(held.agent_id, held.id, first)
        held.cancel_requested = bool(self.connection.exists(cancel_key(job.id)))
        self.publisher.start(job.id, execution.id)
        self.publisher.progress(job, phase="waiting", worker=self.worker.name, prompt_tokens=len(tokens))
        held.timeline.update(enqueued=enqueued, dequeued=dequeued, dequeued_step=self.steps)
        mark(held, "held", self.steps)
        if tokens:  # its KV buffers, made while it waits for its turn and cache (engine.reserve)
            self.engine.reserve(len(tokens), held.sampling.max_tokens)

    # ---- admission ---------------------------------------------------------------------

    def _admit(self) -> None:
        """Submit what the scheduler offers and the engine takes, once the agent's turn and cache are in."""
        if self.draining:
            return
        for held, verdict in self.scheduler.admissions(self.engine):
            if verdict.verdict == "later":
                self._waiting(held, verdict.reason)
            elif verdict.verdict == "never":
                self.end(
                    held, Failed(ErrorCode.CONTEXT_LENGTH_EXCEEDED, self._submit_error(held), retry=False)
                )
            elif self._ready(held):
                mark(held, "cache_ready", self.steps)
                self._submit(held)

    def _ready(self, held: HeldJob) -> bool:
        """Take the agent's turn and start reading its cache; True once both are done (no I/O wait)."""
        if held.agent_id is None:
            return self._prefix_ready(held)
        if self.store is None and not held.extending:
            return True
        if held.fence is None:
            held.fence = self.turns.take(
                held.agent_id, held.id, held_here={h.id for h in self.scheduler.all()}
            )
            if held.fence is None:
                self._waiting(held, "its agent's turn (an earlier job of the agent runs first)")
                return False
        if held.extending:
            return self._extend(held)
        if held.cache is None:
            held.cache = self._prefetch(held.agent_id, held.prompt_tokens, held.fence, self._namespace(held))
        if not held.cache.done():
            self._waiting(held, "its agent's cache (reading)")
            return False
        return True

    def _prefix_ready(self, held: HeldJob) -> bool:
        """A job without an agent: start reading the longest prefix of its prompt any earlier job of its
        namespace stored; True once read (a failed read is a miss: it prefills)."""
        if held.cache is None:
            local = (
                None if self.recent is None else self.recent.longest(held.prompt_tokens, self._tenant(held))
            )
            block = self.engine.spec.block_tokens
            full = len(held.prompt_tokens) // block * block  # the most the store's full blocks can give
            if local is not None and local.n_tokens >= full or not self.prefix_reuse:
                held.cache = Future()
                held.cache.set_result(local)
                return True
            assert self.store is not None
            try:
                held.cache = self.store.prefetch_prefix(held.prompt_tokens, namespace=self._namespace(held))
            except Exception:
                log.exception("job %s: reading a shared prefix failed: prefilling", held.id)
                held.cache = Future()
                held.cache.set_result(local)
                return True
            held.local_prefix = local
        if not held.cache.done():
            self._waiting(held, "a shared prefix (reading)")
            return False
        if held.local_prefix is not None:
            stored = self._prefetched(held, held.cache)
            if stored is None or stored.n_tokens < held.local_prefix.n_tokens:
                held.cache = Future()
                held.cache.set_result(held.local_prefix)
            held.local_prefix = None
        return True

    def _tenant(self, held: HeldJob) -> str:
        """The job's namespace in full (the worker's, narrowed by the job's own)."""
        return self._namespace(held) or self.settings.namespace

    def _namespace(self, held: HeldJob) -> str | None:
        """The tenant of the job's reuse: the worker's, narrowed by the job's own field (never wider)."""
        own = held.request.namespace
        return None if own is None else f"{self.settings.namespace}/{own}"

    def _extend(self, held: HeldJob) -> bool:
        """A continue / fork job with its turn: once its source is read, render the whole conversation
        and become an ordinary job (True when it may be submitted now)."""
        if held.source is None:
            held.source = conversations.start_read(
                self.store, held.request, held.fence, self._namespace(held)
            )
        if not held.source.done():
            self._waiting(held, "its agent's conversation (reading)")
            return False
        source = self._prefetched(held, held.source)
        try:
            request, _stored = conversations.resolve(self.connection, held.request, source, held.id)
            tokens, output, sampling = self._prepare(request)
        except (JobRejected, PromptError) as exc:
            self.end(held, Failed(ErrorCode.INVALID_REQUEST, f"{type(exc).__name__}: {exc}", retry=False))
            return False
        verdict = self.engine.admission(len(tokens), sampling.max_tokens)
        if verdict.verdict == "never":
            reason = conversations.context_message(held.request, len(tokens), verdict.reason)
            self.end(held, Failed(ErrorCode.CONTEXT_LENGTH_EXCEEDED, reason, retry=False))
            return False
        held.stored_messages = len(request.messages or ()) - len(held.request.messages or ())
        held.request, held.prompt_tokens, held.output = request, tokens, output
        held.sampling = stop_after_one_call(sampling, output, request)
        self.engine.reserve(len(tokens), held.sampling.max_tokens)
        cache = conversations.reusable_part(source, tokens)
        if self.recent is not None:  # a new agent (a response's first turn) starts from a recent prefix
            recent = self.recent.longest(tokens, self._tenant(held))
            if recent is not None and (cache is None or recent.n_tokens > cache.n_tokens):
                cache = recent
        held.cache = Future()
        held.cache.set_result(cache)
        held.extending = False
        self.publisher.progress(held.job, prompt_tokens=len(tokens))
        return verdict.verdict == "now"

    def _prefetch(
        self, agent_id: str, prompt_tokens: list[int], fence: int, namespace: str | None
    ) -> Future[AgentCache | None]:
        """The store's read of the agent's cache, as new as its turn (`fence`) needs; a store that
        raises at once fails only this read."""
        assert self.store is not None
        try:
            return self.store.prefetch(
                agent_id, prompt_tokens=prompt_tokens, fence=fence, namespace=namespace
            )
        except Exception as exc:
            failed: Future[AgentCache | None] = Future()
            failed.set_exception(exc)
            return failed

    def _await_reads(self) -> None:
        """Give the cache reads begun for jobs just taken a moment before the batch steps, then admit
        them: a read still under way when the step starts cost its job a whole step (its first token
        came from the step after next), while a store miss or a disk read of a few MB ends in
        milliseconds (often already over here: it ended during the rest of the intake). The batch
        waits at most READ_WAIT_FRACTION of its last step, once per read."""
        reads = [
            read for held in self.scheduler.waiting for read in (held.cache, held.source) if read is not None
        ]
        if not reads or not self.engine.has_work():
            return
        pending = [read for read in reads if not read.done() and read not in self.awaited]
        if pending:
            self.awaited.update(pending)
            wait(pending, timeout=READ_WAIT_FRACTION * self.step_s)
        self._admit()

    def _waiting(self, held: HeldJob, reason: str) -> None:
        if held.wait_reason != reason:
            held.wait_reason = reason
            self.publisher.progress(held.job, phase="waiting", waiting_for=reason)

    def _submit(self, held: HeldJob) -> None:
        cache = self._prefetched_cache(held)
        admitted_at, admitted_mono = time.time(), time.monotonic()
        try:
            try:
                uid = self._engine_submit(held, cache)
            except CacheMismatchError as exc:
                if cache is None:
                    raise
                log.warning(
                    "job %s: agent %s's saved cache unusable (%s): prefilling", held.id, held.agent_id, exc
                )
                self.counts["cache_read_failed"] += 1
                cache = None
                uid = self._engine_submit(held, None)
        except PoolExhaustedError as exc:
            self._waiting(held, f"KV blocks: {exc}")
            return
        except InvalidRequestError as exc:
            self.end(held, Failed(ErrorCode.INVALID_REQUEST, f"{type(exc).__name__}: {exc}", retry=False))
            return
        except Exception:
            self.end(held, Failed(ErrorCode.INTERNAL, traceback.format_exc(), retry=True))
            return
        held.admitted_at = admitted_at
        held.admitted_mono = admitted_mono
        mark(held, "admitted", self.steps)
        if held.agent_id is not None and self.store is not None:
            held.cache_hit = cache is not None
        held.wait_reason = ""
        self.scheduler.start(held, uid)
        self.publisher.progress(held.job, phase="running", waiting_for=None, generated_tokens=0)

    def _submit_error(self, held: HeldJob) -> str:
        """The engine's own words for a request it can never run (it raises, changing nothing)."""
        try:
            uid = self._engine_submit(held, None)
        except InvalidRequestError as exc:
            return f"{type(exc).__name__}: {exc}"
        self.engine.cancel(uid)  # the verdict said never: not reached
        return "the engine refused the request"

    def _engine_submit(self, held: HeldJob, cache: AgentCache | None) -> int:
        if held.agent_id is not None:
            keep_cache = self.store is not None
        else:
            keep_cache = self.prefix_reuse or self.recent is not None
        return self.engine.submit(
            held.agent_id, held.prompt_tokens, held.sampling, cache=cache, keep_cache=keep_cache
        )

    def _prefetched_cache(self, held: HeldJob) -> AgentCache | None:
        return None if held.cache is None else self._prefetched(held, held.cache)

    def _prefetched(self, held: HeldJob, read: Future[AgentCache | None]) -> AgentCache | None:
        """A store read's cache; a failed read is a counted miss (the job prefills instead)."""
        started = time.perf_counter()
        try:
            return read.result()
        except Exception:
            log.exception("job %s: reading agent %s's cache failed: prefilling", held.id, held.agent_id)
            self.counts["cache_read_failed"] += 1
            return None
        finally:
            held.cache_load_s += time.perf_counter() - started

    # ---- engine output -----------------------------------------------------------------

    def _step(self) -> None:
        try:
            self.steps += 1
            self.step_started, cpu = time.time(), time.process_time()
            output = self.engine.step()
            self.step_cpu = (self.step_cpu[1], time.process_time() - cpu)
            self.step_s = time.time() - self.step_started
        except Exception:
            # One forward pass serves the whole batch: a failed step fails every job in it.
            reason = traceback.format_exc()
            log.error("engine step failed; failing %d running job(s)", len(self.scheduler.running))
            for held in list(self.scheduler.running.values()):
                self.end(held, Failed(ErrorCode.ENGINE_ERROR, reason, retry=True))
            return
        self._absorb(output)

    def _absorb(self, output: StepOutput) -> None:
        mono = time.monotonic()
        repeating: list[HeldJob] = []
        for delta in output.deltas:
            held = self.scheduler.by_uid(delta.uid)
            if held is None:
                continue
            held.generated += 1
            if held.generated == 1:
                held.timeline.update(
                    step_started=self.step_started,
                    step_cpu=self.step_cpu[1],
                    step_before_cpu=self.step_cpu[0],
                )
                mark(held, "first_token", self.steps)
            text = delta.text if held.output is None else self._split(held, held.output.feed(delta.text))
            if held.output is not None and held.output.repeated_call:
                repeating.append(held)  # only rows that wrote this step can have just repeated a call
            self.publisher.delta(held.id, text, delta.token)
            if delta.logprobs is not None:
                entry = self.logprob_format(delta.token, delta.logprobs)
                self.publisher.data(held.id, "logprobs", entry.model_dump(mode="json"))
            if mono - held.progress_at >= self.settings.progress_interval:
                held.progress_at = mono
                timeline = {"timeline": held.timeline} if held.generated == 1 else {}
                self.publisher.progress(held.job, generated_tokens=held.generated, **timeline)
        self.counts["tokens"] += len(output.deltas)
        completions = list(output.completions)
        for held in repeating:
            assert held.output is not None and held.uid is not None
            held.output.repeated_call = False  # asked once: its completion comes now or with a step
            if (ended := self.engine.finish(held.uid)) is not None:
                completions.append(ended)
        for completion in completions:
            held = self.scheduler.by_uid(completion.uid)
            if held is not None:
                if held.output is not None and (rest := self._split(held, held.output.finish())):
                    self.publisher.delta(held.id, rest, None)
                self.end(held, Finished(completion))

    def _split(self, held: HeldJob, pieces: list[Piece]) -> str:
        """Publish the reasoning and tool calls among `pieces` as their own events; the answer text."""
        text = []
        for piece in pieces:
            if piece.kind == "reasoning":
                self.publisher.reasoning(held.id, piece.text)
            elif piece.call is not None:
                self.publisher.data(held.id, "tool_call", piece.call.model_dump(mode="json"))
            else:
                text.append(piece.text)
        return "".join(text)

    # ---- the one ending path -------------------------------------------------------------

    def end(self, held: HeldJob, outcome: Outcome) -> None:
        """Decide how `held` ends: out of the scheduler and the engine now, written by `_flush`."""
        if isinstance(outcome, Failed) and outcome.retry and not held.job.should_retry:
            outcome = Failed(outcome.code, outcome.reason, retry=False)  # retry now means: rq will re-run it
        self.scheduler.remove(held)
        if held.uid is not None and not isinstance(outcome, Finished):
            try:
                self.engine.cancel(held.uid)  # frees its blocks; a no-op for a finished sequence
            except Exception:
                log.exception("engine.cancel(%d) failed for job %s", held.uid, held.id)
        held.phase = "ending"
        self.ending.append((held, outcome))

    def _flush(self) -> None:
        """Publish buffered writes, then each decided ending; an outage leaves the rest for next time."""
        self.publisher.flush()
        while self.ending:
            held, outcome = self.ending[0]
            written = self._write_ending(held, outcome)
            self.ending.popleft()
            self.confirmed.written(held, written)
        for held, outcome in self.confirmed.lost():
            # The failover dropped these writes: once more, on the new primary.
            held.end_steps -= {"stream", "rq", "turn"}
            self.counts["endings_rewritten"] += 1
            self.ending.append((held, outcome))
        self.counts["releases_rewritten"] += self.turns.confirm_releases()

    def _write_ending(self, held: HeldJob, outcome: Outcome) -> Outcome:
        """Cache, stream, rq, agent turn: each step once, even when an outage interrupts them. Returns
        the outcome written (TakenOver where the job turned out to be no longer ours)."""
        steps = held.end_steps
        if "cache" not in steps:
            self._save_cache(held, outcome)
            self.scheduler.agent_done(held)  # its cache is in the store: the agent's next job may start
            steps.add("cache")
        if "stream" not in steps:
            if isinstance(outcome, Finished) and not rqexec.owns_execution(
                self.connection, held.job, held.execution
            ):
                outcome = TakenOver(None)  # re-run elsewhere meanwhile: its stream and result are that run's
            self._publish_ending(held.job, outcome, held)
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
        self.counts[_counter(outcome)] += 1
        if not isinstance(outcome, HandedBack | TakenOver):  # those runs go on elsewhere
            completion = outcome.completion if isinstance(outcome, Finished) else None
            observed = job_observations(held, completion, time.time())
            self.latency.observe(observed, outcome=outcome.phase, cache=cache_label(held))
        if isinstance(outcome, Finished):
            self.counts["prompt_tokens"] += outcome.completion.usage.prompt_tokens
            self.counts["reused_tokens"] += outcome.completion.usage.reused_tokens
        self._log_ending(held, outcome)
        return outcome

    def _save_cache(self, held: HeldJob, outcome: Outcome) -> None:
        if not isinstance(outcome, Finished):
            return
        if held.agent_id is None:
            self._save_prefix(held, outcome.completion.cache)
            return
        result = self._result(held, outcome.completion)
        own = len(held.request.messages or ()) - held.stored_messages
        conversation = conversations.record(self.connection, held.request, own, result, held.fence)
        cache = outcome.completion.cache
        if cache is None or self.store is None:
            return
        if self.recent is not None:
            # A new agent of the namespace that re-sends this history (a Responses turn without
            # previous_response_id, a client that rotates its session id) resumes from it to the token.
            self.recent.add(cache, self._tenant(held))
        try:
            cache = dataclasses.replace(cache, conversation=conversation)
            put = self.store.put(held.agent_id, cache, fence=held.fence, namespace=self._namespace(held))
            self.saving.append((held, put))
            if self.settings.store_hot_mb > 0:
                self.affinity.record_home(held.agent_id)
        except Exception:
            # The answer is good; only the next turn's warm start is lost.
            log.exception("job %s: saving agent %s's cache failed", held.id, held.agent_id)
            self.counts["cache_put_failed"] += 1

    def _save_prefix(self, held: HeldJob, cache: AgentCache | None) -> None:
        """Keep a finished agent-less job's full blocks for the next job with the same prefix (best
        effort: the write happens behind, and a failure only costs a later job its reuse)."""
        if cache is None:
            return
        if self.recent is not None:
            self.recent.add(cache, self._tenant(held))
        if self.store is None or not self.prefix_reuse:
            return
        try:
            self.store.put_prefix(cache, namespace=self._namespace(held))
        except Exception:
            log.exception("job %s: keeping its prefix for reuse failed", held.id)

    def _publish_ending(self, job: Job, outcome: Outcome, held: HeldJob | None = None) -> None:
        progress: dict[str, Any] = {"phase": outcome.phase}
        if isinstance(outcome, Finished):
            output = None if held is None else held.output
            self.publisher.end(job.id, answer_finish_reason(output, outcome.completion.finish_reason))
            progress["generated_tokens"] = len(outcome.completion.token_ids)
        elif isinstance(outcome, Failed) and not outcome.retry:
            job.meta[ERROR_META_KEY] = {"code": outcome.code, "message": outcome.message}
            self.publisher.error(job.id, outcome.message)
        elif isinstance(outcome, Canceled):
            self.publisher.end(job.id, "canceled")
        elif isinstance(outcome, Stopped):
            self.publisher.error(job.id, "stopped by rq's stop-job command")
        if not isinstance(outcome, TakenOver):
            self.publisher.progress(job, **progress)
        self.publisher.flush()

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
            result = self._result(held, outcome.completion)
            return rqexec.finish_job(self.worker, job, queue, execution, result)
        if isinstance(outcome, Failed):
            rqexec.fail_job(
                self.worker,
                job,
                queue,
                execution,
                outcome.reason,
                retry=outcome.retry,
                code=outcome.code,
                message=outcome.message,
            )
        elif isinstance(outcome, Canceled):
            rqexec.cancel_job(self.worker, job, queue, execution)
        elif isinstance(outcome, Stopped):
            rqexec.stop_job(self.worker, job, queue, execution)
        elif isinstance(outcome, HandedBack):
            rqexec.requeue_job(self.worker, job, queue, execution, at_front=True)
        else:
            rqexec.drop_execution(self.worker, job, execution)
        return True

    def _result(self, held: HeldJob, completion: Completion) -> dict[str, Any]:
        """The job's result, built once (the conversation record and rq both use it)."""
        if held.result is None:
            held.result = build_result(
                held, completion, model=self.model_name, worker=self.worker.name, logprobs=self.logprob_format
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
            self.turns.leave(agent, held.id)
        self._release_saved_turns()
        if not any(saving is held for saving, _ in self.saving):
            self.turns.release(agent, held.id)

    def _release_saved_turns(self, force: bool = False) -> None:
        """Free the agent locks of jobs whose cache is now durable (or whose put failed)."""
        still: list[tuple[HeldJob, Future[bool]]] = []
        for held, put in self.saving:
            if not put.done() and not force:
                still.append((held, put))
                continue
            try:
                if put.done() and put.result() is False:
                    self.counts["stale_puts"] += 1
            except Exception as exc:
                log.warning("job %s: agent %s's cache was not saved: %s", held.id, held.agent_id, exc)
                self.counts["cache_put_failed"] += 1
            assert held.agent_id is not None
            self.turns.release(held.agent_id, held.id)
        self.saving = still

    def _log_ending(self, held: HeldJob, outcome: Outcome) -> None:
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

    # ---- ending jobs early ---------------------------------------------------------------

    def _take_commands(self) -> None:
        while True:
            try:
                payload: dict[str, Any] = self.worker.commands.get_nowait()
            except Empty:
                return
            held = self.scheduler.by_job_id(str(payload.get("job_id", "")))
            if held is None:
                continue
            if self.connection.exists(cancel_key(held.id)):  # JobHandle.cancel sets it before the command
                held.cancel_requested = True
            else:
                held.stop_requested = True

    def _apply_cancels(self) -> None:
        for held in [h for h in self.scheduler.all() if h.cancel_requested or h.stop_requested]:
            self.end(held, Canceled() if held.cancel_requested else Stopped())

    def _enforce_timeouts(self) -> None:
        now = time.monotonic()
        for held in list(self.scheduler.running.values()):
            timeout = held.timeout_s
            if timeout is not None and held.admitted_mono is not None and now - held.admitted_mono > timeout:
                reason = f"JobTimeoutException: Job exceeded maximum timeout value ({timeout:.0f} seconds)"
                self.end(held, Failed(ErrorCode.TIMEOUT, reason, retry=True))

    def _drain(self) -> None:
        """Waiting jobs go back at once, running ones when the drain timeout is up.

        Each goes to the head of its queue, newest first, so the oldest ends up first and an
        agent's jobs keep their order.
        """
        back = list(self.scheduler.waiting)
        if self.force_stop or time.monotonic() >= self.drain_deadline:
            back += list(self.scheduler.running.values())
        for held in sorted(back, key=lambda h: h.first_enqueued_at, reverse=True):
            self.end(held, HandedBack())

    # ---- liveness ----------------------------------------------------------------------

    def _heartbeat(self) -> None:
        if rqexec.register_again(self.worker):
            log.warning(
                "worker %s had been taken for dead (cut off from Redis): registered again", self.worker.name
            )
        held = self.scheduler.all()
        signals = rqexec.heartbeat(self.worker, [(h.job, h.execution) for h in held], self.worker_fields())
        for agent in self.turns.refresh():
            log.warning("agent %s: lock taken over elsewhere while this worker held it", agent)
        for h in held:
            sig = signals[h.id]
            if sig.cancel_requested or sig.status == JobStatus.CANCELED:
                h.cancel_requested = True
            elif not sig.still_ours:
                self.end(h, TakenOver(sig.status))
        self.next_heartbeat = time.monotonic() + self.settings.heartbeat_interval

    def worker_fields(self) -> dict[str, str | int]:
        """What kvrq adds to its rq worker hash: capacity for producers, load for `kvrq status`."""
        store_stats = self.store.stats() if self.store is not None else {}
        return {
            CAPACITY_FIELD: self.settings.held_limit,
            MODEL_FIELD: self.model_name,
            CONTEXT_FIELD: self.engine.max_context,
            MAX_BATCH_FIELD: self.settings.max_batch,
            POOL_BLOCKS_FIELD: self.engine.pool.total_blocks,
            FREE_BLOCKS_FIELD: self.engine.pool.free_blocks,
            RUNNING_FIELD: len(self.scheduler.running),
            WAITING_FIELD: len(self.scheduler.waiting),
            PROMPT_TOKENS_FIELD: self.counts["prompt_tokens"],
            REUSED_TOKENS_FIELD: self.counts["reused_tokens"],
            **self._cache_fields(store_stats),
            MEMORY_FIELD: memory_field(self.engine.memory(), store_stats),
            LATENCY_FIELD: self.latency.field(),
        }

    @staticmethod
    def _cache_fields(stats: dict[str, int]) -> dict[str, int]:
        hot_hits, hot_misses = stats.get("hot_hits", 0), stats.get("hot_misses", 0)
        return {
            HOT_AGENTS_FIELD: stats.get("hot_entries", 0),
            CACHE_LOOKUPS_FIELD: hot_hits + hot_misses,
            HOT_HITS_FIELD: hot_hits,
            CACHE_HITS_FIELD: hot_hits + stats.get("hits", 0),
        }

    def _check_crashes(self) -> None:
        names = [q.name for q in self.worker.queues]
        self.beacon.beat()  # alive by definition: a key expired in an outage must not re-run our jobs
        report = rerun_crashed(self.connection, names, crash_reruns=self.settings.crash_reruns)
        self.counts["crash_reruns"] += sum(len(ids) for ids in report.rerun.values())
        self.next_crash_check = time.monotonic() + self.settings.crash_check_interval

    def _maintenance(self) -> None:
        names = [q.name for q in self.worker.queues]
        clean_queues(self.connection, names, crash_reruns=self.settings.crash_reruns)
        self.next_maintenance = time.monotonic() + self.settings.maintenance_interval
        log.debug("held %d, counts %s", len(self.scheduler), self.counts)


def _counter(outcome: Outcome) -> str:
    return "dropped" if isinstance(outcome, TakenOver) else outcome.phase


def _first_enqueued(job: Job, enqueued: float) -> float:
    """The job's first enqueue time, kept in its meta across re-runs (junk there is replaced)."""
    first = job.meta.get(FIRST_ENQUEUED_META_KEY)
    if isinstance(first, bool) or not isinstance(first, int | float) or not 0 < first <= enqueued:
        first = job.meta[FIRST_ENQUEUED_META_KEY] = enqueued
    return float(first)
