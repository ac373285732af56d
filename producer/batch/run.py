"""A batch run as a named object in Redis: its state, its counts and the ids of its rq jobs.

The run record lets `kvrq batch status` and `kvrq batch cancel` work from any machine, while the client
driving the run is alive or after it died. Keys (built in producer/wire/protocol.py):
- `kvrq:batch:run:<run_id>`: hash with state (submitting | running | done | canceled), counts (total,
  queued, running, done, failed, invalid), queue, input/output paths, timestamps, the driving client.
- `kvrq:batch:run:<run_id>:jobs`: set of the rq job ids the run enqueued.
- `kvrq:batch:runs`: sorted set of run ids by creation time.
Records of finished or canceled runs expire after RUN_TTL_S. Records written before kvrq spelled it
"canceled" say "cancelled": reads accept both.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from redis import Redis
from redis.exceptions import WatchError
from redis.typing import EncodableT, FieldT

from producer.wire.protocol import BATCH_RUNS_KEY, batch_jobs_key, batch_run_key

RunState = Literal["submitting", "running", "done", "canceled"]
COUNT_FIELDS = ("total", "queued", "running", "done", "failed", "invalid")
RUN_TTL_S = 7 * 24 * 3600
INDEX_TTL_S = 30 * 24 * 3600  # `kvrq batch status` lists runs started within this window
RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
_SAFE_CUSTOM_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def derive_run_id(input_bytes: bytes, queue: str, tenant: str | None = None) -> str:
    """Same input file and queue give the same run, which is what makes a rerun resume it; another
    tenant's run of the same file is another run (its own jobs and results)."""
    digest = hashlib.sha256()
    digest.update(queue.encode())
    digest.update(b"\0")
    if tenant is not None:
        digest.update(f"tenant\0{tenant}\0".encode())
    digest.update(input_bytes)
    return f"batch-{digest.hexdigest()[:16]}"


def validate_run_id(run_id: str) -> str:
    if not RUN_ID_PATTERN.fullmatch(run_id):
        raise ValueError(f"run id {run_id!r} must be 1-64 letters, digits, '-' or '_'")
    return run_id


def job_id_for(run_id: str, custom_id: str) -> str:
    """Deterministic rq job id of a line, so a rerun finds the job instead of enqueuing it twice.

    rq job ids allow only letters, digits, '-' and '_': other custom_ids are hashed (the `x` form).
    """
    if _SAFE_CUSTOM_ID.fullmatch(custom_id):
        return f"{run_id}_c_{custom_id}"
    return f"{run_id}_x_{hashlib.sha256(custom_id.encode()).hexdigest()[:32]}"


@dataclass
class RunInfo:
    """What `kvrq batch status` shows: the stored record of a run."""

    run_id: str
    state: str
    queue: str
    counts: dict[str, int]
    fields: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "state": self.state, "queue": self.queue, **self.counts, **self.fields}


class BatchRun:
    """Read and write one run's record; every method is a few Redis commands, safe to call often."""

    def __init__(self, connection: Redis, run_id: str) -> None:
        self.connection = connection
        self.run_id = validate_run_id(run_id)
        self.key = batch_run_key(run_id)
        self.jobs_key = batch_jobs_key(run_id)

    def start(
        self, *, queue: str, total: int, input_path: str, output_path: str, concurrency: int
    ) -> str | None:
        """Create the record or take it over for a rerun; returns the state it had before (None if new)."""
        now = repr(time.time())
        previous = self.connection.hget(self.key, "state")
        pipe = self.connection.pipeline()
        pipe.hsetnx(self.key, "created_at", now)
        pipe.hset(
            self.key,
            mapping={
                "run_id": self.run_id,
                "queue": queue,
                "state": "submitting",
                "total": total,
                "input": input_path,
                "output": output_path,
                "concurrency": concurrency,
                "client": f"{socket.gethostname()}:{os.getpid()}",
                "updated_at": now,
                "heartbeat_at": now,
            },
        )
        pipe.persist(self.key)
        pipe.persist(self.jobs_key)
        pipe.zadd(BATCH_RUNS_KEY, {self.run_id: time.time()}, nx=True)
        pipe.zremrangebyscore(BATCH_RUNS_KEY, "-inf", time.time() - INDEX_TTL_S)  # keeps the index small
        pipe.execute()
        return _state(previous)

    def add_jobs(self, job_ids: Iterable[str]) -> None:
        """Record job ids before they are enqueued, so the run always knows every job it may own."""
        ids = list(job_ids)
        if ids:
            self.connection.sadd(self.jobs_key, *ids)

    def job_ids(self) -> set[str]:
        return {_text(j) for j in self.connection.smembers(self.jobs_key)}

    def update(self, *, state: RunState | None = None, **counts: int) -> str | None:
        """Store counts and state, beat the client's heartbeat; returns the state stored before.

        A canceled run stays canceled (only "done" replaces it): `kvrq batch cancel` may land between
        the driver's read and its write, so the check and the write are one transaction.
        """
        with self.connection.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(self.key)
                    before = _state(pipe.hget(self.key, "state"))
                    now = repr(time.time())
                    mapping: dict[FieldT, EncodableT] = {"updated_at": now, "heartbeat_at": now}
                    mapping.update(counts)
                    if state is not None and not (before == "canceled" and state != "done"):
                        mapping["state"] = state
                    final = mapping.get("state", before) in ("done", "canceled")
                    pipe.multi()
                    pipe.hset(self.key, mapping=mapping)
                    if final:
                        pipe.expire(self.key, RUN_TTL_S)
                        pipe.expire(self.jobs_key, RUN_TTL_S)
                    pipe.execute()
                    return before
                except WatchError:
                    continue

    def state(self) -> str | None:
        return _state(self.connection.hget(self.key, "state"))

    def mark_canceled(self) -> None:
        self.connection.hset(self.key, "canceled_at", repr(time.time()))
        self.update(state="canceled")

    def info(self) -> RunInfo | None:
        raw = self.connection.hgetall(self.key)
        if not raw:
            return None
        data = {_text(k): _text(v) for k, v in raw.items()}
        counts = {name: int(data.pop(name, "0") or 0) for name in COUNT_FIELDS}
        state = _state(data.pop("state", None)) or "unknown"
        queue = data.pop("queue", "")
        data.pop("run_id", None)
        data["jobs"] = str(self.connection.scard(self.jobs_key))
        return RunInfo(self.run_id, state, queue, counts, data)


def list_runs(connection: Redis, limit: int = 20) -> list[RunInfo]:
    """The most recent runs still recorded, newest first."""
    infos: list[RunInfo] = []
    stale: list[str] = []
    for raw in connection.zrevrange(BATCH_RUNS_KEY, 0, limit * 2 - 1):
        run_id = _text(raw)
        info = BatchRun(connection, run_id).info()
        if info is None:
            stale.append(run_id)
        elif len(infos) < limit:
            infos.append(info)
    if stale:
        connection.zrem(BATCH_RUNS_KEY, *stale)
    return infos


def _state(raw: Any) -> str | None:
    """A stored run state; "cancelled" (records from before kvrq spelled it rq's way) reads as "canceled"."""
    if raw is None:
        return None
    state = _text(raw)
    return "canceled" if state == "cancelled" else state


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
