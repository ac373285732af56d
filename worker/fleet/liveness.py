"""Worker liveness: a key each live worker refreshes from a thread of its own, so a dead one is
noticed within seconds (rq's own job heartbeats expire after minutes).

The beacon runs beside the engine loop, so a long step does not make a live worker look
dead; a `kill -9`, an OOM kill or a lost host stops it. Workers and `kvrq maintenance`
re-run the jobs of workers whose key is gone (worker/fleet/maintenance.py).
"""

from __future__ import annotations

import contextlib
import logging
import threading

from redis import Redis
from redis.exceptions import RedisError

from producer.wire.protocol import worker_alive_key

log = logging.getLogger("kvrq.worker")


class LivenessBeacon:
    def __init__(self, connection: Redis, worker_name: str, ttl_s: float) -> None:
        self.connection = connection
        self.key = worker_alive_key(worker_name)
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.interval_s = ttl_s / 4
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvrq-liveness", daemon=True)

    def start(self) -> None:
        self.beat()
        self._thread.start()

    def beat(self) -> None:
        self.connection.set(self.key, "1", px=self.ttl_ms)

    def _run(self) -> None:
        failing = False
        while not self._stop.wait(self.interval_s):
            try:
                self.beat()
                failing = False
            except RedisError as exc:
                if not failing:
                    log.warning("liveness beacon cannot reach Redis (%s): retrying", exc)
                failing = True

    def stop(self) -> None:
        """Stop beating and say so at once (a clean exit is not a crash)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        with contextlib.suppress(RedisError):
            self.connection.delete(self.key)


def alive(connection: Redis, worker_names: list[str]) -> dict[str, bool]:
    if not worker_names:
        return {}
    with connection.pipeline(transaction=False) as pipe:
        for name in worker_names:
            pipe.exists(worker_alive_key(name))
        return {name: bool(flag) for name, flag in zip(worker_names, pipe.execute(), strict=True)}
