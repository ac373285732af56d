"""The worker's one loop: rq jobs in, engine steps, token streams and results out.

Each iteration: publish what the last step produced; apply cancels; heartbeat every
held job (and run the abandoned-job cleanup now and then); admit waiting jobs into the
engine while its slots and KV blocks allow; dequeue more jobs without blocking while the
engine has work (blocking for a second only when it is idle); one `engine.step()`.

Single-threaded on purpose: the engine, the store and every rq write happen here. The
only other thread is rq's pubsub listener, which hands stop commands over a queue.
"""

from __future__ import annotations

import logging
import signal
import time
import traceback
from collections import deque
from queue import Empty
from types import FrameType
from typing import TYPE_CHECKING, Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from rq.exceptions import DequeueTimeout
from rq.job import Job, JobStatus
from rq.queue import Queue

from engine.errors import CacheMismatchError, InvalidRequestError, PoolExhaustedError
from producer.protocol import cancel_key
from worker import rqexec
from worker.agentlocks import AgentLocks
from worker.backoff import Backoff
from worker.held import HeldJob
from worker.jobs import JobRejected, request_from_job
from worker.maintenance import clean_queues
from worker.ports import Engine, Store
from worker.prompts import PromptError, prompt_tokens
from worker.publisher import Publisher
from worker.results import build_result
from worker.scheduler import Scheduler
from worker.settings import WorkerSettings

if TYPE_CHECKING:
    from engine.blocks import AgentCache
    from engine.results import Completion, StepOutput

log = logging.getLogger("kvrq.worker")
#: Jobs this worker holds at once; batch runs read it to size their concurrency.
CAPACITY_FIELD = "kvrq_capacity"

REDIS_DOWN = (RedisConnectionError, RedisTimeoutError)


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
        self.store = store
        self.worker = rq_worker
        self.settings = settings
        self.model_name = model_name
        self.idle_wait_s = idle_wait_s  # 0: never block on an empty queue (tests)
        self.connection = rq_worker.connection
        self.scheduler = Scheduler()
        self.publisher = Publisher(
            self.connection, stream_ttl=settings.stream_ttl, stream_maxlen=settings.stream_maxlen
        )
        self.locks = AgentLocks(self.connection, rq_worker.name, settings.heartbeat_ttl)
        self.finishing: deque[tuple[HeldJob, Completion]] = deque()
        self.pool_blocked = False
        self.draining = False
        self.force_stop = False
        self.drain_deadline = 0.0
        self.backoff = Backoff()
        self.next_heartbeat = 0.0
        self.next_maintenance = 0.0
        self.counts = {"finished": 0, "failed": 0, "canceled": 0, "requeued": 0, "tokens": 0}

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
        self.worker.register_birth()
        self.connection.hset(self.worker.key, mapping=self.worker_fields())  # type: ignore[arg-type]
        self.worker.subscribe()
        self.worker.set_state("idle")
        log.info(
            "worker %s listening on %s (max_batch %d, pool %d blocks)",
            self.worker.name,
            ", ".join(q.name for q in self.worker.queues),
            self.settings.max_batch,
            self.engine.pool.total_blocks,
        )

    def run(self) -> int:
        """Run until stopped and drained. Redis outages are waited out with backoff."""
        while True:
            try:
                if self.run_once():
                    break
                self.backoff.reset()
            except REDIS_DOWN as exc:
                if self.force_stop:
                    # Nothing can be handed back without Redis; heartbeats stop, so the
                    # abandoned-job cleanup re-queues or fails what is held here.
                    log.error(
                        "Redis unreachable during a forced stop (%s): leaving held jobs to cleanup", exc
                    )
                    break
                delay = self.backoff.next()
                log.warning("Redis unreachable (%s): retry %d in %.1f s", exc, self.backoff.failures, delay)
                time.sleep(delay)
        self.shutdown()
        return 0

    def shutdown(self) -> None:
        if self.store is not None:
            try:
                self.store.close()
            except Exception:
                log.exception("store close failed: write-behind caches may be lost")
        try:
            self.worker.register_death()
            self.worker.unsubscribe()
        except REDIS_DOWN as exc:
            log.warning("could not unregister from Redis: %s", exc)
        log.info("worker %s stopped: %s", self.worker.name, self.counts)

    # ---- one iteration -------------------------------------------------------------------

    def run_once(self) -> bool:
        """One pass of the loop; True once a stop was requested and nothing is held any more."""
        self._flush()
        self._take_commands()
        now = time.monotonic()
        if now >= self.next_heartbeat:
            self._heartbeat()
        if now >= self.next_maintenance and not self.draining:
            self._maintenance()
        self._apply_cancels()
        self._enforce_timeouts()
        if self.draining:
            self._drain()
            if not self.scheduler and not self.finishing:
                return True
        else:
            self._admit()
            self._fill()
        if self.engine.has_work():
            self._step()
            self._flush()
        rqexec.set_busy(self.worker, bool(self.scheduler))
        return False

    # ---- intake ------------------------------------------------------------------------

    def _wants_more(self) -> bool:
        return (
            not self.draining
            and not self.pool_blocked
            and len(self.scheduler) < self.settings.held_limit
            and self.engine.free_slots() > self.scheduler.count_admissible()
        )

    def _fill(self) -> None:
        block = self.idle_wait_s > 0 and not self.engine.has_work()
        while self._wants_more():
            dequeued = self._dequeue(block)
            block = False
            if dequeued is None:
                return
            self._take(*dequeued)
            self._admit()

    def _dequeue(self, block: bool) -> tuple[Job, Queue] | None:
        try:
            return Queue.dequeue_any(
                self.worker.queues,
                self.idle_wait_s if block else None,
                connection=self.connection,
                job_class=self.worker.job_class,
                serializer=self.worker.serializer,
            )
        except DequeueTimeout:
            return None

    def _take(self, job: Job, queue: Queue) -> None:
        """A dequeued job: validate, mark started, and queue it for admission."""
        if job.get_status(refresh=False) == JobStatus.CANCELED:
            queue.intermediate_queue.remove(job.id)
            return
        try:
            request = request_from_job(job)
            tokens = prompt_tokens(self.engine.tokenizer, request)
        except (JobRejected, PromptError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
            log.warning("job %s rejected: %s", job.id, reason)
            self.publisher.error(job.id, reason)
            self.publisher.flush()
            rqexec.reject_job(self.worker, job, queue, reason)
            self.counts["failed"] += 1
            return
        execution = rqexec.start_job(self.worker, job, queue)
        held = HeldJob(
            job=job,
            queue=queue,
            execution=execution,
            request=request,
            prompt_tokens=tokens,
            enqueued_at=job.enqueued_at.timestamp() if job.enqueued_at else time.time(),
            held_at=time.monotonic(),
        )
        self.scheduler.add(held)  # held from here on: an outage below cannot orphan it
        held.cancel_requested = bool(self.connection.exists(cancel_key(job.id)))
        self.publisher.start(job.id, execution.id)
        self.publisher.progress(job, phase="waiting", worker=self.worker.name, prompt_tokens=len(tokens))

    # ---- admission ---------------------------------------------------------------------

    def _admit(self) -> None:
        """Submit waiting jobs to the engine, oldest first, while it has room.

        A job that does not fit now stops admission (nothing overtakes it, so a large job
        cannot starve) and keeps later jobs in the queue; one that can never fit fails.
        """
        self.pool_blocked = False
        if self.draining:
            return
        for held in self.scheduler.admissible():
            if self.engine.free_slots() <= 0:
                return
            if held.cancel_requested:
                continue
            n_prompt, max_tokens = len(held.prompt_tokens), held.request.max_tokens
            if not self.engine.can_admit(n_prompt, max_tokens):
                never_fits = (
                    self.engine.spec.blocks_for(n_prompt + max_tokens) > self.engine.pool.total_blocks
                )
                if self.engine.active() > 0 and not never_fits:
                    self._waiting(held, "KV blocks")
                    self.pool_blocked = True
                    return
            if held.agent_id is not None and not self.locks.acquire(held.agent_id, held.id):
                self._waiting(held, "agent busy on another worker")
                continue
            if not self._submit(held) and self.pool_blocked:
                return

    def _waiting(self, held: HeldJob, reason: str) -> None:
        if held.wait_reason != reason:
            held.wait_reason = reason
            self.publisher.progress(held.job, phase="waiting", waiting_for=reason)

    def _submit(self, held: HeldJob) -> bool:
        cache, load_s = self._load_cache(held)
        submitted_at, submitted_mono = time.time(), time.monotonic()
        try:
            try:
                uid = self._engine_submit(held, cache)
            except CacheMismatchError as exc:
                if cache is None:
                    raise
                log.warning(
                    "job %s: saved cache of agent %s unusable (%s): prefilling", held.id, held.agent_id, exc
                )
                uid = self._engine_submit(held, None)
        except PoolExhaustedError:
            self._release_lock(held)
            self._waiting(held, "KV blocks")
            self.pool_blocked = True
            return False
        except InvalidRequestError as exc:
            self._fail(held, f"{type(exc).__name__}: {exc}", retry=False)
            return False
        except Exception:
            self._fail(held, traceback.format_exc(), retry=True)
            return False
        held.admitted_at = submitted_at
        held.admitted_mono = submitted_mono
        held.cache_load_s = load_s
        held.wait_reason = ""
        self.scheduler.start(held, uid)
        self.publisher.progress(held.job, phase="running", waiting_for=None, generated_tokens=0)
        return True

    def _engine_submit(self, held: HeldJob, cache: AgentCache | None) -> int:
        request = held.request
        return self.engine.submit(
            held.agent_id,
            held.prompt_tokens,
            cache=cache,
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            seed=request.seed,
            stop=tuple(request.stop),
            keep_cache=held.agent_id is not None and self.store is not None,
        )

    def _load_cache(self, held: HeldJob) -> tuple[AgentCache | None, float]:
        if held.agent_id is None or self.store is None:
            return None, 0.0
        started = time.perf_counter()
        try:
            cache = self.store.get(held.agent_id, prompt_tokens=held.prompt_tokens)
        except Exception:
            log.exception("job %s: reading agent %s's cache failed: prefilling", held.id, held.agent_id)
            cache = None
        return cache, time.perf_counter() - started

    # ---- engine output -----------------------------------------------------------------

    def _step(self) -> None:
        try:
            output = self.engine.step()
        except Exception:
            # One forward pass serves the whole batch: a failed step fails every job in it.
            reason = traceback.format_exc()
            log.error("engine step failed; failing %d running job(s)", len(self.scheduler.running))
            for held in list(self.scheduler.running.values()):
                self._fail(held, reason, retry=True)
            return
        self._absorb(output)

    def _absorb(self, output: StepOutput) -> None:
        wall, mono = time.time(), time.monotonic()
        for delta in output.deltas:
            held = self.scheduler.running.get(delta.uid)
            if held is None:
                continue
            if held.first_token_at is None:
                held.first_token_at = wall
            held.generated += 1
            self.publisher.delta(held.id, delta.text, delta.token)
            if mono - held.progress_at >= self.settings.progress_interval:
                held.progress_at = mono
                self.publisher.progress(held.job, generated_tokens=held.generated)
        self.counts["tokens"] += len(output.deltas)
        for completion in output.completions:
            done = self.scheduler.finish(completion.uid)
            if done is not None:
                done.phase = "finishing"
                self.finishing.append((done, completion))

    def _flush(self) -> None:
        self.publisher.flush()
        while self.finishing:
            held, completion = self.finishing[0]
            self._complete(held, completion)
            self.finishing.popleft()

    def _complete(self, held: HeldJob, completion: Completion) -> None:
        """Save the agent's cache, close the stream, finish the rq job: each once, even across outages."""
        steps = held.finish_steps
        if "cache" not in steps:
            if held.agent_id is not None and completion.cache is not None and self.store is not None:
                self._save_cache(held, completion.cache)
            steps.add("cache")
        if "stream" not in steps:
            self.publisher.end(held.id, completion.finish_reason)
            self.publisher.progress(held.job, phase="finished", generated_tokens=len(completion.token_ids))
            self.publisher.flush()
            steps.add("stream")
        if "rq" not in steps:
            result = build_result(held, completion, model=self.model_name, worker=self.worker.name)
            rqexec.finish_job(self.worker, held.job, held.queue, held.execution, result)
            steps.add("rq")
            self.counts["finished"] += 1
            log.info(
                "job %s (agent %s) %s: %d tokens, %d of %d prompt tokens reused",
                held.id,
                held.agent_id,
                completion.finish_reason,
                len(completion.token_ids),
                completion.usage.reused_tokens,
                completion.usage.prompt_tokens,
            )
        self._release_lock(held)

    def _save_cache(self, held: HeldJob, cache: AgentCache) -> None:
        assert held.agent_id is not None and self.store is not None
        try:
            self.store.put(held.agent_id, cache)
        except Exception:
            # The answer is good; only the next turn's warm start is lost.
            log.exception("job %s: saving agent %s's cache failed", held.id, held.agent_id)

    # ---- ending jobs early -------------------------------------------------------------

    def _release_lock(self, held: HeldJob) -> None:
        if held.agent_id is not None:
            self.locks.release(held.agent_id, held.id)

    def _remove(self, held: HeldJob) -> None:
        """Take a held job out of the scheduler and the engine (its blocks are freed)."""
        if held.uid is not None and held.uid in self.scheduler.running:
            self.scheduler.finish(held.uid)
            try:
                self.engine.cancel(held.uid)
            except Exception:
                log.exception("engine.cancel(%d) failed for job %s", held.uid, held.id)
        elif held in self.scheduler.waiting:
            self.scheduler.drop_waiting(held)

    def _fail(self, held: HeldJob, reason: str, *, retry: bool) -> None:
        self._remove(held)
        will_retry = retry and held.job.should_retry
        log.warning("job %s failed%s: %s", held.id, " (will retry)" if will_retry else "", reason.strip())
        if not will_retry:
            self.publisher.error(held.id, reason.strip().splitlines()[-1])
        self.publisher.progress(held.job, phase="failed")
        self.publisher.flush()
        rqexec.fail_job(self.worker, held.job, held.queue, held.execution, reason, retry=retry)
        self._release_lock(held)
        self.counts["failed"] += 1

    def _take_commands(self) -> None:
        while True:
            try:
                payload: dict[str, Any] = self.worker.commands.get_nowait()
            except Empty:
                return
            held = self.scheduler.by_job_id(str(payload.get("job_id", "")))
            if held is not None:
                held.cancel_requested = True

    def _apply_cancels(self) -> None:
        for held in [h for h in self.scheduler.all() if h.cancel_requested]:
            self._remove(held)
            self.publisher.end(held.id, "cancelled")
            self.publisher.progress(held.job, phase="canceled")
            self.publisher.flush()
            rqexec.cancel_job(self.worker, held.job, held.queue, held.execution)
            self._release_lock(held)
            self.counts["canceled"] += 1
            log.info("job %s canceled", held.id)

    def _enforce_timeouts(self) -> None:
        now = time.monotonic()
        for held in list(self.scheduler.running.values()):
            timeout = held.timeout_s
            if timeout is not None and held.admitted_mono is not None and now - held.admitted_mono > timeout:
                self._fail(
                    held,
                    f"JobTimeoutException: Job exceeded maximum timeout value ({timeout:.0f} seconds)",
                    retry=True,
                )

    def _requeue(self, held: HeldJob) -> None:
        self._remove(held)
        self.publisher.progress(held.job, phase="requeued")
        self.publisher.flush()
        rqexec.requeue_job(self.worker, held.job, held.queue, held.execution, at_front=True)
        self._release_lock(held)
        self.counts["requeued"] += 1
        log.info("job %s handed back to queue %s", held.id, held.queue.name)

    def _drain(self) -> None:
        """Waiting jobs go back at once, running ones when the drain timeout is up.

        Each goes to the head of its queue, newest first, so the oldest ends up first and an
        agent's jobs keep their order.
        """
        back = list(self.scheduler.waiting)
        if self.force_stop or time.monotonic() >= self.drain_deadline:
            back += list(self.scheduler.running.values())
        for held in sorted(back, key=lambda h: h.enqueued_at, reverse=True):
            self._requeue(held)

    # ---- liveness ----------------------------------------------------------------------

    def _heartbeat(self) -> None:
        held = self.scheduler.all()
        signals = rqexec.heartbeat(self.worker, [(h.job, h.execution) for h in held], self.worker_fields())
        running_agents = {h.agent_id: h.id for h in self.scheduler.running.values() if h.agent_id is not None}
        for agent in self.locks.refresh(running_agents):
            log.warning("agent %s: lock taken over by another worker while its job runs here", agent)
        for h in held:
            sig = signals[h.id]
            if sig.cancel_requested or sig.status == JobStatus.CANCELED:
                h.cancel_requested = True
            elif not sig.still_ours:
                # Another process decided about this job (abandoned-job cleanup, deletion): let go.
                log.warning("job %s is %s now, no longer ours: dropping it", h.id, sig.status)
                self._remove(h)
                rqexec.drop_execution(self.worker, h.job, h.execution)
                self._release_lock(h)
        self.next_heartbeat = time.monotonic() + self.settings.heartbeat_interval

    def worker_fields(self) -> dict[str, str | int]:
        """What kvrq adds to its rq worker hash: capacity for producers, load for `kvrq status`."""
        return {
            CAPACITY_FIELD: self.settings.held_limit,
            "kvrq_model": self.model_name,
            "kvrq_max_batch": self.settings.max_batch,
            "kvrq_pool_blocks": self.engine.pool.total_blocks,
            "kvrq_free_blocks": self.engine.pool.free_blocks,
            "kvrq_running": len(self.scheduler.running),
            "kvrq_waiting": len(self.scheduler.waiting),
        }

    def _maintenance(self) -> None:
        clean_queues(self.connection, [q.name for q in self.worker.queues])
        self.next_maintenance = time.monotonic() + self.settings.maintenance_interval
        log.debug("held %d, counts %s", len(self.scheduler), self.counts)
