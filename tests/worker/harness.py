"""A worker loop on fakeredis with a fake engine and store, driven one iteration at a time."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import fakeredis

from producer.client import JobHandle, Producer
from producer.wire.protocol import StreamEvent, stream_key
from tests.producer.fakes import fake_redis
from tests.worker.fakes import DictStore, FakeEngine
from worker.jobs.rqexec import KvrqWorker
from worker.loop.worker_loop import WorkerLoop
from worker.settings import WorkerSettings


class Harness:
    def __init__(self, pool_blocks: int = 4096, max_batch: int = 4, **settings: object) -> None:
        self.server = fakeredis.FakeServer()
        self.redis = fake_redis(self.server)
        self.engine = FakeEngine(pool_blocks=pool_blocks, max_batch=max_batch)
        self.store = DictStore()
        self.settings = WorkerSettings(
            heartbeat_interval=0.05,
            max_batch=max_batch,
            # fakeredis runs no Lua (the scheduler); maintenance only where a test asks for it
            **{"scheduler_interval": 0, "maintenance_interval": 3600, **settings},  # type: ignore[arg-type]
        )
        self.loop = self.new_loop()
        self.producer = Producer(connection=fake_redis(self.server))

    def new_loop(self, engine: FakeEngine | None = None) -> WorkerLoop:
        worker = KvrqWorker(
            ["kvrq"],
            connection=fake_redis(self.server),
            heartbeat_ttl=self.settings.heartbeat_ttl,
            affinity=self.settings.affinity,
        )
        worker.register_birth()
        loop = WorkerLoop(
            engine=engine or self.engine,
            store=self.store,
            rq_worker=worker,
            settings=self.settings,
            model_name="fake",
            idle_wait_s=0,
        )
        loop.beacon.beat()  # alive, without the beacon's thread: tests delete the key to "kill" it
        return loop

    def run_until(self, done: Callable[[], bool], max_iterations: int = 500) -> None:
        for _ in range(max_iterations):
            if done():
                return
            self.loop.beacon.beat()  # what the beacon's thread does: a slow, busy machine never looks dead
            self.loop.run_once()
        raise AssertionError("condition not reached")

    def statuses(self, handles: list) -> list[str]:  # type: ignore[type-arg]
        return [h.status() for h in handles]

    def all_ended(self, handles: list) -> Callable[[], bool]:  # type: ignore[type-arg]
        return lambda: all(s in ("finished", "failed", "canceled") for s in self.statuses(handles))


def stored_events(h: Harness, handle: JobHandle) -> list[StreamEvent]:
    """The job's whole stream as stored (a reader's `events()` stops at the first closing)."""
    entries: Any = h.redis.xrange(stream_key(handle.id))
    return [StreamEvent.from_fields(fields) for _, fields in entries]
