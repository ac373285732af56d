"""What every phase of the loop works on, wired once: WorkerLoop builds one LoopParts and each phase
(admission, intake, step, endings, upkeep) takes it, instead of each taking and storing the same dozen
arguments."""

from __future__ import annotations

from dataclasses import dataclass

from redis import Redis

from worker.fleet.affinity import Affinity
from worker.fleet.agent_turns import AgentTurns
from worker.jobs import rqexec
from worker.loop.ports import Engine, Store
from worker.loop.publisher import Publisher
from worker.loop.recent_prefixes import RecentPrefixes
from worker.loop.scheduler import Scheduler
from worker.loop.timeline import StepClock
from worker.requests.logprobs import LogprobFormatter
from worker.settings import WorkerSettings


@dataclass(frozen=True)
class LoopParts:
    """One worker's shared state; the loop's single thread is its only user."""

    worker: rqexec.KvrqWorker
    engine: Engine
    store: Store | None
    scheduler: Scheduler  # the jobs held: waiting for admission and running in the engine
    publisher: Publisher  # buffered stream and progress writes
    turns: AgentTurns  # the agent turns (locks) held
    affinity: Affinity
    settings: WorkerSettings
    model_name: str
    logprob_format: LogprobFormatter
    clock: StepClock  # engine steps run so far
    counts: dict[str, int]
    #: Jobs without an agent resume from (and feed) the shared prefixes of their namespace, and the
    #: whole caches recent ones left in this worker's memory (token-granular).
    recent: RecentPrefixes | None
    prefix_reuse: bool

    @property
    def connection(self) -> Redis:
        return self.worker.connection
