"""The worker's one loop: rq jobs in, engine steps, token streams and results out.

Each iteration (`run_once`), in this order, over phases that return what happened (worker/loop/):
1. flush: publish the buffered stream/progress writes and write the endings decided so far (endings.py);
2. upkeep: stop-job commands from rq's pubsub thread; heartbeats of held jobs and agent locks, crash
   re-runs, rq's registry cleanup and rq's scheduler when due (upkeep.py); the agent turns whose cache
   put became durable are released (durability.py);
3. cancels and job timeouts end jobs (stops.py);
4. admission (the scheduler's policy, the engine's verdict, the agent's turn and cache: admission.py)
   and intake (dequeue without blocking while there is room; block for a second only when idle:
   intake.py); or, once a stop was requested, hand jobs back;
5. one engine step, its output absorbed into each row's stream (step.py), then flush again.

Every phase hands its endings back (`Ending` values); the loop passes them to the one ending path.
Single-threaded on purpose: the engine, the store calls and every rq write happen here.
Other threads: rq's pubsub listener (hands stop commands over a queue), the liveness
beacon, and the store's own I/O threads (prefetch, write-behind), which the loop only polls.
"""

from __future__ import annotations

import logging
import signal
import time
from collections import deque
from types import FrameType

from producer.wire.redis_url import REDIS_DOWN
from worker.fleet.affinity import Affinity
from worker.fleet.agent_turns import AgentTurns
from worker.fleet.confirmed_endings import ConfirmedEndings
from worker.fleet.latency import LatencyHistograms
from worker.fleet.liveness import LivenessBeacon
from worker.jobs import rqexec
from worker.loop.admission import Admitter
from worker.loop.backoff import Backoff
from worker.loop.endings import Endings, Rejected
from worker.loop.intake import Intake
from worker.loop.outcomes import COUNTERS, Ending
from worker.loop.parts import LoopParts
from worker.loop.ports import Engine, Store
from worker.loop.publisher import Publisher
from worker.loop.recent_prefixes import RecentPrefixes
from worker.loop.scheduler import Scheduler
from worker.loop.step import Stepper
from worker.loop.stops import Stops
from worker.loop.timeline import StepClock
from worker.loop.upkeep import Upkeep
from worker.requests.logprobs import LogprobFormatter
from worker.settings import WorkerSettings

log = logging.getLogger("kvrq.worker")

COUNT_NAMES = (
    *COUNTERS,
    "tokens",
    "prompt_tokens",
    "reused_tokens",
    "cache_read_failed",
    "crash_reruns",
    "cache_put_failed",
    "stale_puts",
    "endings_rewritten",  # dropped by a failover, written again (worker/fleet/confirmed_endings.py)
    "releases_rewritten",  # agent-turn releases a failover dropped, made again (agent_turns.py)
)


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
        self.counts = dict.fromkeys(COUNT_NAMES, 0)
        self.scheduler = Scheduler(settings.held_limit)
        self.publisher = Publisher(
            self.connection, stream_ttl=settings.stream_ttl, stream_maxlen=settings.stream_maxlen
        )
        self.turns = AgentTurns(self.connection, rq_worker.name, settings.heartbeat_ttl)
        self.beacon = LivenessBeacon(self.connection, rq_worker.name, settings.liveness_ttl)
        prefix_reuse = store is not None and settings.prefix_cache_mb != 0
        recent_bytes = int(settings.recent_prefix_mb * 1024 * 1024)
        self.parts = LoopParts(
            worker=rq_worker,
            engine=engine,
            store=store,
            scheduler=self.scheduler,
            publisher=self.publisher,
            turns=self.turns,
            affinity=Affinity(
                self.connection, rq_worker, enabled=settings.affinity, wait_s=settings.affinity_wait
            ),
            settings=settings,
            model_name=model_name,
            logprob_format=LogprobFormatter(engine.tokenizer),
            clock=StepClock(),
            counts=self.counts,
            recent=RecentPrefixes(recent_bytes) if recent_bytes > 0 else None,
            prefix_reuse=prefix_reuse,
        )
        self.stepper = Stepper(self.parts)
        self.endings = Endings(self.parts)
        self.intake = Intake(self.parts, idle_wait_s=idle_wait_s)
        self.admitter = Admitter(self.parts)
        self.stops = Stops(rq_worker, self.connection, self.scheduler)
        self.upkeep = Upkeep(self.parts, beacon=self.beacon, latency=self.endings.latency)
        self.draining = False
        self.force_stop = False
        self.drain_deadline = 0.0
        self.backoff = Backoff()

    @property
    def ending(self) -> deque[Ending]:
        """The endings decided and not yet written (tests and `kvrq status` read it)."""
        return self.endings.queue

    @property
    def confirmed(self) -> ConfirmedEndings:
        return self.endings.confirmed

    @property
    def latency(self) -> LatencyHistograms:
        return self.endings.latency

    @property
    def step_s(self) -> float:
        return self.parts.clock.seconds

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
        self.connection.hset(self.worker.key, mapping=self.upkeep.worker_fields())  # type: ignore[arg-type]
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
                if self.draining and not self.scheduler and not self.endings.queue:
                    # Stopping with nothing held and nothing left to write: Redis is not needed
                    # (its registrations expire). A stack stopped all at once (honcho, Ctrl-C)
                    # stops Redis first; waiting for it kept the worker up until SIGKILL.
                    log.warning("Redis unreachable while stopping with nothing held (%s): stopping", exc)
                    break
                delay = self.backoff.next(exc)
                self.upkeep.after_outage(delay)
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
            self.endings.durability.release(force=True)
            self.upkeep.scheduled.stop()  # another worker takes the scheduler locks at its next run
            self.worker.register_death()
            self.worker.unsubscribe()
        except REDIS_DOWN as exc:
            log.warning("could not unregister from Redis: %s", exc)
        self.beacon.stop()
        log.info("worker %s stopped: %s", self.worker.name, self.counts)

    # ---- one iteration -------------------------------------------------------------------

    def run_once(self) -> bool:
        """One pass of the loop; True once a stop was requested and nothing is held any more."""
        end = self.endings.end_all
        self.endings.flush()
        self.stops.take_commands()
        end(self.upkeep.due(self.draining))
        self.endings.durability.release()
        end(self.stops.requested())
        end(self.stops.timed_out())
        if self.draining:
            end(self.stops.hand_back(self.force_stop or time.monotonic() >= self.drain_deadline))
            self.endings.flush()
            if not self.scheduler and not self.endings.queue:
                return True
        else:
            self._admit()
            self._fill()
            if self.admitter.await_reads():
                self._admit()
        if self.engine.has_work():
            end(self.stepper.step())
            self.endings.flush()
        rqexec.set_busy(self.worker, bool(self.scheduler))
        return False

    def _admit(self) -> None:
        if not self.draining:  # a stop signal may arrive mid-pass
            self.endings.end_all(self.admitter.admit())

    def _fill(self) -> None:
        """Dequeue while the scheduler wants more, admitting after each job taken."""
        block = self.idle_wait_s > 0 and not self.engine.has_work() and not self.scheduler
        while self.scheduler.wants_more(self.engine.free_slots()):
            dequeued = self.intake.next_job(block)
            block = False
            if dequeued is None:
                return
            taken = self.intake.take(*dequeued)
            if isinstance(taken, Rejected):
                self.endings.reject(taken)
            self._admit()
