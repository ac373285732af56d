"""Buffered writes of token streams and job progress: one Redis round trip per engine step.

Writes are kept until `flush()` succeeds, so a step's tokens survive a Redis outage and
are published once it is back (a transaction: all of a flush lands, or none of it).
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from redis import Redis
from rq.job import Job
from rq.serializers import resolve_serializer

from producer.wire.protocol import SERIALIZER, StreamEvent, stream_key

log = logging.getLogger("kvrq.worker")


class Publisher:
    def __init__(self, connection: Redis, *, stream_ttl: int, stream_maxlen: int) -> None:
        self.connection = connection
        self.stream_ttl = stream_ttl
        self.stream_maxlen = stream_maxlen
        self._events: list[tuple[str, dict[str, str]]] = []
        self._meta: dict[str, bytes] = {}  # job key -> serialized meta (latest wins)
        self._serializer = resolve_serializer(SERIALIZER)

    def event(self, job_id: str, event: StreamEvent) -> None:
        self._events.append((stream_key(job_id), event.to_fields()))

    def delta(self, job_id: str, text: str, token: int | None) -> None:
        self.event(job_id, StreamEvent("delta", text=text, token=token))

    def reasoning(self, job_id: str, text: str) -> None:
        self.event(job_id, StreamEvent("reasoning", text=text))

    def data(self, job_id: str, kind: Literal["tool_call", "logprobs"], data: dict[str, Any]) -> None:
        self.event(job_id, StreamEvent(kind, data=data))

    def start(self, job_id: str, attempt: str) -> None:
        self.event(job_id, StreamEvent("start", attempt=attempt))

    def end(self, job_id: str, finish_reason: str, usage: dict[str, int] | None = None) -> None:
        """The stream's last event; a finished job's carries its usage (as its result's)."""
        data = None if usage is None else {"usage": usage}
        self.event(job_id, StreamEvent("end", finish_reason=finish_reason, data=data))

    def error(self, job_id: str, reason: str, code: str | None = None) -> None:
        self.event(job_id, StreamEvent("error", error=reason, code=code))

    def progress(self, job: Job, **progress: Any) -> None:
        """Merge `progress` into job.meta["progress"] (what `rq info -v` and dashboards show)."""
        current = job.meta.get("progress")
        merged = {**current, **progress} if isinstance(current, dict) else dict(progress)
        job.meta["progress"] = merged
        try:
            self._meta[job.key] = self._serializer.dumps(job.meta)
        except (TypeError, ValueError):
            # A meta kvrq cannot write back as JSON (a pickled job's): leave it as the client wrote it.
            log.debug("job %s: meta is not JSON, progress not published", job.id)

    @property
    def pending(self) -> int:
        return len(self._events) + len(self._meta)

    def flush(self) -> None:
        if not self._events and not self._meta:
            return
        with self.connection.pipeline(transaction=True) as pipe:
            touched: set[str] = set()
            for key, fields in self._events:
                pipe.xadd(key, fields, maxlen=self.stream_maxlen, approximate=True)  # type: ignore[arg-type]
                touched.add(key)
            for key in touched:
                pipe.expire(key, self.stream_ttl)
            for job_key, meta in self._meta.items():
                pipe.hset(job_key, "meta", meta)
            pipe.execute()
        self._events.clear()
        self._meta.clear()
