"""The loop's periodic duties toward rq and the fleet: heartbeats (held jobs, agent locks, the worker's
hash), crash re-runs of dead workers' jobs, rq's registry cleanup and rq's scheduler
(worker/jobs/scheduled_jobs.py: why not a forked process). A heartbeat returns the held jobs found
taken over."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

from rq.job import JobStatus

from producer.wire import protocol as wire
from worker.fleet.latency import LatencyHistograms
from worker.fleet.liveness import LivenessBeacon
from worker.fleet.maintenance import clean_queues, rerun_crashed
from worker.fleet.memory import memory_field
from worker.jobs import rqexec
from worker.jobs.scheduled_jobs import ScheduledJobs
from worker.loop.outcomes import Ending, TakenOver
from worker.loop.parts import LoopParts

log = logging.getLogger("kvrq.worker")


class Upkeep:
    def __init__(self, parts: LoopParts, *, beacon: LivenessBeacon, latency: LatencyHistograms) -> None:
        self.parts = parts
        self.beacon = beacon
        self.latency = latency
        names = [q.name for q in parts.worker.queues]
        self.scheduled = ScheduledJobs(
            parts.connection, names, parts.worker.name, parts.settings.scheduler_interval
        )
        self.next_heartbeat = 0.0
        self.next_crash_check = 0.0
        self.next_maintenance = 0.0

    def due(self, draining: bool) -> Iterator[Ending]:
        """Run the duties that are due; yields the held jobs a heartbeat found taken over."""
        now = time.monotonic()
        if now >= self.next_heartbeat:
            yield from self.heartbeat()
        if not draining and now >= self.next_crash_check:
            self._check_crashes()
        if not draining and now >= self.next_maintenance:
            self._maintenance()
        if self.scheduled.due(now):
            self.scheduled.run(now)  # while draining too: due jobs go to the queue for the others

    def after_outage(self, delay: float) -> None:
        """Every liveness key may have expired meanwhile: both checks that re-run dead workers' jobs (the
        crash check, and maintenance's) wait until the peers have beaten again."""
        peers_beat = time.monotonic() + delay + self.parts.settings.liveness_ttl
        self.next_crash_check = peers_beat
        self.next_maintenance = max(self.next_maintenance, peers_beat)

    def heartbeat(self) -> Iterator[Ending]:
        if rqexec.register_again(self.parts.worker):
            log.warning(
                "worker %s had been taken for dead (cut off from Redis): registered again",
                self.parts.worker.name,
            )
        held = self.parts.scheduler.all()
        signals = rqexec.heartbeat(
            self.parts.worker, [(h.job, h.execution) for h in held], self.worker_fields()
        )
        for agent in self.parts.turns.refresh():
            log.warning("agent %s: lock taken over elsewhere while this worker held it", agent)
        for h in held:
            sig = signals[h.id]
            if sig.cancel_requested or sig.status == JobStatus.CANCELED:
                h.cancel_requested = True
            elif not sig.still_ours:
                yield h, TakenOver(sig.status)
        self.next_heartbeat = time.monotonic() + self.parts.settings.heartbeat_interval

    def worker_fields(self) -> dict[str, str | int]:
        """What kvrq adds to its rq worker hash: capacity for producers, load for `kvrq status`."""
        store_stats = self.parts.store.stats() if self.parts.store is not None else {}
        return {
            wire.CAPACITY_FIELD: self.parts.settings.held_limit,
            wire.MODEL_FIELD: self.parts.model_name,
            wire.CONTEXT_FIELD: self.parts.engine.max_context,
            wire.MAX_BATCH_FIELD: self.parts.settings.max_batch,
            wire.POOL_BLOCKS_FIELD: self.parts.engine.pool.total_blocks,
            wire.FREE_BLOCKS_FIELD: self.parts.engine.pool.free_blocks,
            wire.RUNNING_FIELD: len(self.parts.scheduler.running),
            wire.WAITING_FIELD: len(self.parts.scheduler.waiting),
            wire.PROMPT_TOKENS_FIELD: self.parts.counts["prompt_tokens"],
            wire.REUSED_TOKENS_FIELD: self.parts.counts["reused_tokens"],
            **_cache_fields(store_stats),
            wire.MEMORY_FIELD: memory_field(self.parts.engine.memory(), store_stats),
            wire.LATENCY_FIELD: self.latency.field(),
        }

    def _check_crashes(self) -> None:
        names = [q.name for q in self.parts.worker.queues]
        self.beacon.beat()  # alive by definition: a key expired in an outage must not re-run our jobs
        report = rerun_crashed(self.parts.connection, names, crash_reruns=self.parts.settings.crash_reruns)
        self.parts.counts["crash_reruns"] += sum(len(ids) for ids in report.rerun.values())
        self.next_crash_check = time.monotonic() + self.parts.settings.crash_check_interval

    def _maintenance(self) -> None:
        names = [q.name for q in self.parts.worker.queues]
        clean_queues(self.parts.connection, names, crash_reruns=self.parts.settings.crash_reruns)
        self.next_maintenance = time.monotonic() + self.parts.settings.maintenance_interval
        log.debug("held %d, counts %s", len(self.parts.scheduler), self.parts.counts)


def _cache_fields(stats: dict[str, int]) -> dict[str, int]:
    hot_hits, hot_misses = stats.get("hot_hits", 0), stats.get("hot_misses", 0)
    return {
        wire.HOT_AGENTS_FIELD: stats.get("hot_entries", 0),
        wire.CACHE_LOOKUPS_FIELD: hot_hits + hot_misses,
        wire.HOT_HITS_FIELD: hot_hits,
        wire.CACHE_HITS_FIELD: hot_hits + stats.get("hits", 0),
    }
