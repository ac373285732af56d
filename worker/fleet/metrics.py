"""An optional Prometheus endpoint (`--metrics-port`, off unless asked, loopback by default).

Nothing is pushed: a scrape reads the worker's own counters (`WorkerLoop.counts`), its store's
counters, its per-job latency histograms (worker/fleet/latency.py) and the queue depths at that moment.
Rates and quantiles are the scraper's job: `rate(kvrq_generated_tokens_total[1m])`, the
PromQL list in docs/worker.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from engine.batch.speculation import SpeculationStats
from producer.wire.protocol import shared_queue_of
from worker.fleet.latency import HISTOGRAMS, LatencyHistograms
from worker.loop.outcomes import COUNTERS

if TYPE_CHECKING:
    from worker.loop.worker_loop import WorkerLoop


class WorkerCollector:
    def __init__(self, loop: WorkerLoop) -> None:
        self.loop = loop

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        loop = self.loop
        counts = dict(loop.counts)
        stats = loop.store.stats() if loop.store is not None else {}
        labels = ["worker"]
        me = [loop.worker.name]

        jobs = CounterMetricFamily(
            "kvrq_jobs", "jobs ended by this worker, by outcome", labels=[*labels, "outcome"]
        )
        for outcome in COUNTERS:
            jobs.add_metric([*me, outcome], counts.get(outcome, 0))
        yield jobs
        for name, key, text in (
            ("kvrq_generated_tokens", "tokens", "tokens generated"),
            ("kvrq_prompt_tokens", "prompt_tokens", "prompt tokens of finished jobs"),
            ("kvrq_reused_tokens", "reused_tokens", "prompt tokens whose KV came from a saved cache"),
            ("kvrq_crash_reruns", "crash_reruns", "jobs of dead workers this worker re-queued"),
            ("kvrq_cache_read_failures", "cache_read_failed", "agent caches that could not be used"),
            ("kvrq_cache_put_failures", "cache_put_failed", "agent caches that could not be saved"),
        ):
            family = CounterMetricFamily(name, text, labels=labels)
            family.add_metric(me, counts.get(key, 0))
            yield family
        hot_hits, hot_misses = stats.get("hot_hits", 0), stats.get("hot_misses", 0)
        for name, value, text in (
            ("kvrq_cache_lookups", hot_hits + hot_misses, "agent cache lookups"),
            (
                "kvrq_cache_hits",
                hot_hits + stats.get("hits", 0),
                "lookups served from the hot tier or the store",
            ),
            ("kvrq_cache_hot_hits", hot_hits, "lookups served from the hot tier"),
            (
                "kvrq_cache_evictions",
                stats.get("evictions", 0) + stats.get("hot_evictions", 0),
                "caches evicted",
            ),
        ):
            family = CounterMetricFamily(name, text, labels=labels)
            family.add_metric(me, value)
            yield family
        drafting = loop.engine.speculation_stats() or SpeculationStats()
        for name, count, text in (
            ("kvrq_drafting_steps", drafting.steps, "engine steps that verified drafts"),
            ("kvrq_draft_tokens", drafting.proposed, "draft tokens verified"),
            ("kvrq_accepted_draft_tokens", drafting.accepted, "draft tokens accepted"),
        ):
            family = CounterMetricFamily(name, text, labels=labels)
            family.add_metric(me, count)
            yield family
        held = GaugeMetricFamily("kvrq_jobs_held", "jobs this worker holds", labels=[*labels, "state"])
        held.add_metric([*me, "running"], len(loop.scheduler.running))
        held.add_metric([*me, "waiting"], len(loop.scheduler.waiting))
        yield held
        free = GaugeMetricFamily("kvrq_kv_blocks_free", "free blocks in the KV pool", labels=labels)
        free.add_metric(me, loop.engine.pool.free_blocks)
        yield free
        depth = GaugeMetricFamily(
            "kvrq_queue_depth", "jobs waiting in each queue this worker serves", labels=["queue"]
        )
        for queue in loop.worker.queues:
            if shared_queue_of(queue.name) == queue.name:
                depth.add_metric([queue.name], queue.count)
        yield depth
        yield from histogram_families(loop.latency, loop.worker.name)


def histogram_families(latency: LatencyHistograms, worker: str) -> Iterator[Any]:
    """One Prometheus histogram per latency figure, by worker, outcome and cache hit/miss."""
    from prometheus_client.core import HistogramMetricFamily

    for key, histogram in HISTOGRAMS.items():
        family = HistogramMetricFamily(histogram.name, histogram.help, labels=["worker", "outcome", "cache"])
        for (name, outcome, cache), counts in sorted(latency.counts.items()):
            if name != key:
                continue
            cumulative, buckets = 0, []
            for bound, count in zip([*histogram.bounds, float("inf")], counts, strict=True):
                cumulative += count
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
            family.add_metric([worker, outcome, cache], buckets, latency.sums[(name, outcome, cache)])
        yield family


def serve_metrics(loop: WorkerLoop, port: int, host: str = "127.0.0.1") -> Any:
    """Start the endpoint on a thread of its own; returns the server (`.shutdown()` stops it)."""
    from prometheus_client import start_http_server
    from prometheus_client.core import CollectorRegistry

    registry = CollectorRegistry()
    registry.register(WorkerCollector(loop))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server
