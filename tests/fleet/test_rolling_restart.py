"""A rolling restart of a fleet under a multi-agent load: no job lost, none run twice, no cache missed.

Real `kvrq worker` processes (builtin SmolLM2, a few tokens a turn) share one redis-server for their
queue and their agent caches (`--store redis`, as docs/scale-out.md runs a fleet). Agents talk without
pause (tests/fleet/agents.py). The workers are restarted one at a time as an operator rolls a fleet:
SIGTERM (a graceful drain), wait for the exit, start the new process, wait until it registered, next.
Then every agent takes one more turn. Checked: every job finished with one result and one stream
ending, every later turn reused at least its previous turn's whole prompt (no agent missed its cache,
across restarts and moves between workers), every agent's conversation record holds each turn once,
and every worker exited 0. The default suite restarts one of two workers; `-m chaos` rolls four workers
five times over (20 restarts).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from producer.client import Producer
from tests.conftest import RedisServer
from tests.fleet.agents import AgentLoad
from tests.worker.procs import WorkerProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow]


class Fleet:
    """Workers on one Redis; `restart(i)` replaces worker i by a fresh process (a new name)."""

    def __init__(self, workdir: Path, size: int) -> None:
        self.workdir = workdir
        self.redis = RedisServer(workdir / "redis")
        self.size = size
        self.workers: list[WorkerProcess] = []
        self.exit_codes: list[int] = []
        self.restarts = 0

    def _worker(self, slot: int) -> WorkerProcess:
        name = f"kvrq-roll-{slot}-{self.restarts}"
        return WorkerProcess(self.redis.url, self.workdir, name=name, args=["--store", "redis"])

    def start(self) -> Fleet:
        (self.workdir / "redis").mkdir()
        self.redis.start()
        self.workers = [self._worker(slot) for slot in range(self.size)]
        with ThreadPoolExecutor(self.size) as pool:  # started together: the model loads overlap
            list(pool.map(WorkerProcess.start, self.workers))
        return self

    def restart(self, slot: int) -> float:
        """SIGTERM worker `slot`, wait for its exit, start its successor; seconds until it registered."""
        began = time.monotonic()
        self.exit_codes.append(self.workers[slot].terminate())
        self.restarts += 1
        self.workers[slot] = self._worker(slot).start()
        return time.monotonic() - began

    def stop(self) -> None:
        for worker in self.workers:
            worker.stop()
        self.redis.stop(kill=True)


@pytest.fixture
def fleet(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Fleet]:
    started = Fleet(tmp_path, size=getattr(request, "param", 2)).start()
    yield started
    started.stop()


def roll(fleet: Fleet, agents: int, restarts: int) -> None:
    """`restarts` restarts, one worker at a time in turn (slot 0, 1, ..., 0, ...), under the load."""
    with Producer(fleet.redis.url) as producer:
        load = AgentLoad(producer, [f"agent-{i}" for i in range(agents)]).start()
        try:
            load.wait_for_turns(agents)  # every agent has a cache somewhere before the first restart
            for restart in range(restarts):
                took = fleet.restart(restart % fleet.size)
                print(f"restart {restart} (worker {restart % fleet.size}): registered after {took:.1f} s")
                load.wait_for_turns(2)  # the new fleet serves before the next worker goes
        finally:
            load.finish()
        for worker in fleet.workers:
            assert not worker.exited(), worker.log()[-4000:]
        items = load.delivery()
        print(f"{len(load.all_turns())} turns over {fleet.restarts} restarts: {items}")
        assert (items["failed"], items["lost"], items["duplicated"]) == (0, 0, 0), items
        assert items["finished"] == len(load.all_turns())
        assert load.misses() == []
        assert load.records_out_of_step() == {}
        assert fleet.exit_codes == [0] * fleet.restarts


@pytest.mark.timeout(1200)  # 312 s on this 2-core machine at load average 15-19 (other jobs)
def test_a_rolling_restart_loses_no_job_and_no_cache(fleet: Fleet) -> None:
    roll(fleet, agents=3, restarts=1)


@pytest.mark.chaos
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("fleet", [4], indirect=True)
def test_five_rolling_restarts_of_four_workers(fleet: Fleet) -> None:
    roll(fleet, agents=8, restarts=4 * 5)
