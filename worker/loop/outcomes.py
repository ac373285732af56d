"""How a held job ends: one value per kind of ending, each naming its phase, counter and stream event.

The one ending path (`Endings.end`, worker/loop/endings.py) takes one of these; everything users see
(the job's progress phase in job.meta, the stream's last event, the rq registry it lands
in, the worker's counters) is derived from it, so the vocabulary is spelled once: rq's
("finished", "failed", "canceled", "requeued").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from engine.core.results import Completion
    from worker.loop.held import HeldJob

#: Phases published in job.meta["progress"]["phase"]: a held job's life as users see it.
ProgressPhase = Literal[
    "waiting", "running", "finished", "failed", "canceled", "stopped", "requeued", "dropped"
]


@dataclass(frozen=True)
class Finished:
    """The engine completed it: save the agent's cache, close the stream, return the result."""

    completion: Completion
    phase: ProgressPhase = "finished"


@dataclass(frozen=True)
class Failed:
    """It cannot finish here. `retry`: rq re-queues it while its `retries` last (a transient failure)."""

    code: str  # producer.wire.protocol.ErrorCode
    reason: str
    retry: bool
    phase: ProgressPhase = "failed"

    @property
    def message(self) -> str:
        lines = [line for line in self.reason.strip().splitlines() if line.strip()]
        return lines[-1].strip() if lines else self.code


@dataclass(frozen=True)
class Canceled:
    """The producer canceled it (`JobHandle.cancel`, rq's `job.cancel()`)."""

    phase: ProgressPhase = "canceled"


@dataclass(frozen=True)
class Stopped:
    """rq's stop-job command (`send_stop_job_command`, `rq` CLI, dashboards) stopped it: STOPPED, as in rq."""

    phase: ProgressPhase = "stopped"


@dataclass(frozen=True)
class HandedBack:
    """Back to the head of its queue, to run again from the start on any worker (drain)."""

    phase: ProgressPhase = "requeued"


@dataclass(frozen=True)
class TakenOver:
    """Someone else decided about it (crash re-run, deletion, cleanup): let go, write nothing about it."""

    status: str | None
    phase: ProgressPhase = "dropped"


Outcome = Finished | Failed | Canceled | Stopped | HandedBack | TakenOver
#: What a phase hands back to the loop: this held job ends so (written by `Endings`).
Ending = tuple["HeldJob", Outcome]

COUNTERS = ("finished", "failed", "canceled", "stopped", "requeued", "dropped")
