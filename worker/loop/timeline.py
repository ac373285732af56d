"""A job's way to its first token, milestone by milestone: what `bench_worker.py --warm-join` splits
a warm join's latency with (queue, cache load, engine, publish), in engine steps as well as seconds.

Each milestone is recorded once, as the unix time and the number of engine steps the worker had run
(`<name>` and `<name>_step`), and the CPU seconds of the step that gave the first token and of the one
before it (`step_cpu`, `step_before_cpu`: a measure of the join step's cost that a loaded machine
does not blur as it does wall time); the worker publishes them in the job's progress (`timeline`) with the
progress write of its first token, which it makes anyway.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

from worker.loop.held import HeldJob

#: dequeued: the worker took it from Redis; held: parsed, tokenized and started in rq; cache_ready: its
#: agent's turn taken and cache (or shared prefix) read; admitted: engine.submit() returned; first_token:
#: the step that sampled it returned (that step began at `step_started`).
Milestone = Literal["dequeued", "held", "cache_ready", "admitted", "first_token"]


def mark(held: HeldJob, milestone: Milestone, steps: int) -> None:
    """Record `milestone` now, unless it already was (a job waiting for KV blocks passes `_ready` again)."""
    if milestone not in held.timeline:
        held.timeline[milestone] = time.time()
        held.timeline[f"{milestone}_step"] = steps


@dataclass
class StepClock:
    """The engine steps run so far: the unit of a job's timeline (`mark`)."""

    count: int = 0
    started: float = 0.0  # unix time the latest step began
    #: CPU seconds (all threads) of the step before the latest, and of the latest.
    cpu: tuple[float, float] = (0.0, 0.0)
    seconds: float = 0.0  # wall seconds of the latest step
