"""Per-job latency histograms: queue wait, cache load, first token, total time, tokens/s.

Kept as plain bucket counts (prometheus_client is optional: `kvrq[metrics]`), labelled by how
the job ended and whether it resumed from a saved cache. The metrics endpoint serves them as
Prometheus histograms (worker/fleet/metrics.py); the worker's rq hash carries them summed over the
labels (LATENCY_FIELD, each heartbeat), from which `kvrq status` prints p50/p95 per worker with
the interpolation PromQL's `histogram_quantile` uses, so both agree. What one job contributes:
worker/loop/results.py (`job_observations`). No engine import: `kvrq status` reads this module.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from typing import Literal

SECONDS_BOUNDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0, 600.0)
RATE_BOUNDS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0)

#: Cache label: "hit" resumed from a saved cache, "miss" an agent's job that prefilled from
#: scratch, "none" a job without an agent (or one that ended before it entered the engine).
CacheLabel = Literal["hit", "miss", "none"]


@dataclass(frozen=True)
class Histogram:
    name: str  # Prometheus family name (base units in the name)
    help: str
    bounds: tuple[float, ...]


HISTOGRAMS = {
    "queue_wait": Histogram(
        "kvrq_job_queue_wait_seconds",
        "enqueue until the job entered the engine (cache load included)",
        SECONDS_BOUNDS,
    ),
    "cache_load": Histogram(
        "kvrq_job_cache_load_seconds", "store time left on the critical path at admission", SECONDS_BOUNDS
    ),
    "first_token": Histogram(
        "kvrq_job_first_token_seconds", "enqueue until the first generated token", SECONDS_BOUNDS
    ),
    "total": Histogram("kvrq_job_duration_seconds", "enqueue until the job ended", SECONDS_BOUNDS),
    "tokens_per_second": Histogram(
        "kvrq_job_tokens_per_second", "generated tokens per second in the engine, per job", RATE_BOUNDS
    ),
}
Observations = dict[str, float | None]


class LatencyHistograms:
    """Bucket counts per (histogram, outcome, cache) and their sums: what Prometheus needs."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str, str], list[int]] = {}
        self.sums: dict[tuple[str, str, str], float] = {}

    def observe(self, values: Observations, *, outcome: str, cache: CacheLabel) -> None:
        for key, value in values.items():
            if value is None:
                continue
            histogram = HISTOGRAMS[key]
            labels = (key, outcome, cache)
            counts = self.counts.setdefault(labels, [0] * (len(histogram.bounds) + 1))
            counts[bisect.bisect_left(histogram.bounds, value)] += 1  # bucket: value <= bound
            self.sums[labels] = self.sums.get(labels, 0.0) + value

    def summed(self) -> dict[str, list[int]]:
        """Counts per bucket of each histogram over all labels."""
        total: dict[str, list[int]] = {}
        for (key, _, _), counts in self.counts.items():
            into = total.setdefault(key, [0] * len(counts))
            for index, count in enumerate(counts):
                into[index] += count
        return total

    def field(self) -> str:
        """The worker-hash value (LATENCY_FIELD)."""
        summed = self.summed()
        return json.dumps(
            {
                key: {"bounds": list(h.bounds), "counts": summed[key]}
                for key, h in HISTOGRAMS.items()
                if key in summed
            }
        )


def quantile(q: float, bounds: list[float] | tuple[float, ...], counts: list[int]) -> float | None:
    """`histogram_quantile` on per-bucket counts (the last one +Inf): linear inside the bucket, the
    highest finite bound when it falls in +Inf, None without observations."""
    total = sum(counts)
    if total == 0:
        return None
    rank = q * total
    seen = 0
    for index, count in enumerate(counts):
        if count and seen + count >= rank:
            if index >= len(bounds):
                return float(bounds[-1])
            lower = 0.0 if index == 0 else float(bounds[index - 1])
            return lower + (float(bounds[index]) - lower) * (rank - seen) / count
        seen += count
    return float(bounds[-1])


def percentiles(field: str | None) -> dict[str, tuple[float, float]]:
    """(p50, p95) of each histogram in a worker's LATENCY_FIELD; {} when absent or unreadable."""
    try:
        data = json.loads(field) if field else {}
    except ValueError:
        return {}
    found = {}
    for key, entry in data.items() if isinstance(data, dict) else ():
        try:
            p50, p95 = (quantile(q, entry["bounds"], entry["counts"]) for q in (0.5, 0.95))
        except (KeyError, TypeError, ValueError):
            continue
        if p50 is not None and p95 is not None:
            found[key] = (p50, p95)
    return found
