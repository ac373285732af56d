"""benchmarks/chaos_checks.py's checks of each job after a chaos run (delivered exactly once), which the
integration tests and benchmarks/chaos.py share."""

from __future__ import annotations

from benchmarks.chaos_checks import (
    ENDED,
    Delivery,
    attempts,
    crash_reruns,
    deliveries,
    delivery,
    results_of,
    stream_events,
    summary,
)

__all__ = [
    "ENDED",
    "Delivery",
    "attempts",
    "crash_reruns",
    "deliveries",
    "delivery",
    "results_of",
    "stream_events",
    "summary",
]
