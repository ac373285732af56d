"""What an enqueue writes, decided once for both clients: rq's own job hash and queue entries.

rq is synchronous, so the asyncio client cannot call `Queue.enqueue_call`; instead rq enqueues into a
`Recorder` standing in for a pipeline, and each client sends the recorded writes on its own pipeline
(client.py on redis-py's, aio.py on redis.asyncio's). The Redis state is then rq's exactly, whichever
client wrote it: a worker takes the job and rq's `Job.fetch` reads it as if `enqueue_call` had run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rq import Queue, Retry

from producer.models import GenerationRequest
from producer.tenants import Tenant
from producer.waits import Wait, read
from producer.wire.protocol import (
    JOB_FUNCTION,
    SERIALIZER,
    agent_home_key,
    worker_alive_key,
    worker_queue_name,
)
from producer.wire.text import as_text

#: Seconds a started job may run when the request names no job_timeout (rq's own default is 180).
DEFAULT_JOB_TIMEOUT = 600
#: The Redis version a recording JobWriter's queues assume (rq would ask with INFO; it only stamps it
#: on the job object and picks commands for old servers by it).
_ASSUMED_SERVER_VERSION = (7, 0, 0)


@dataclass
class Recorder:
    """A pipeline that runs nothing: it keeps each write rq makes, to be sent by a real one."""

    writes: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = field(default_factory=list)
    explicit_transaction: bool = True  # rq opens none of its own on a pipeline it was handed

    def multi(self) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)

        def record(*args: Any, **kwargs: Any) -> None:
            self.writes.append((name, args, kwargs))

        return record

    def replay(self, pipe: Any) -> None:
        """Queue every recorded write on `pipe` (a redis-py or redis.asyncio pipeline)."""
        for name, args, kwargs in self.writes:
            getattr(pipe, name)(*args, **kwargs)


class NoConnection:
    """What a recording JobWriter's rq Queue holds: rq reads nothing there, and any use would be a bug."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"rq used the connection ({name}) while recording an enqueue")


def validated(
    requests: Sequence[GenerationRequest | Mapping[str, Any]], tenant: Tenant | None
) -> list[GenerationRequest]:
    """Every request checked (none enqueued if one is invalid) and made its tenant's."""
    checked = [_validate(request) for request in requests]
    return checked if tenant is None else [tenant.request(request) for request in checked]


def _validate(request: GenerationRequest | Mapping[str, Any]) -> GenerationRequest:
    if isinstance(request, GenerationRequest):
        return GenerationRequest.model_validate(request.model_dump())
    return GenerationRequest.model_validate(dict(request))


def agents_to_place(requests: Sequence[GenerationRequest], affinity: bool) -> list[str]:
    """The agents whose hot worker an enqueue looks up (none without affinity)."""
    return sorted({r.agent_id for r in requests if r.agent_id is not None}) if affinity else []


def home_keys(agents: Sequence[str]) -> list[str]:
    return [agent_home_key(agent) for agent in agents]


def homes_of(agents: Sequence[str], found: Sequence[Any]) -> dict[str, str]:
    """agent -> the worker its home key names (from an MGET of `home_keys`)."""
    return {agent: as_text(worker) for agent, worker in zip(agents, found, strict=True) if worker}


def alive_keys(homes: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """(the workers among `homes`, their liveness keys)."""
    workers = sorted({worker for worker in homes.values() if worker})
    return workers, [worker_alive_key(worker) for worker in workers]


def placing(requests: Sequence[GenerationRequest], affinity: bool) -> Wait[dict[str, str]]:
    """agent id -> the live worker holding its cache hot, for the agents among `requests` (none without
    `affinity`): the agents' home keys read, then their workers' liveness keys. Sans-I/O (waits.py's
    steps): each client sends the two MGETs its own way, inside its enqueue's retry."""
    agents = agents_to_place(requests, affinity)
    if not agents:
        return {}
    homes = homes_of(agents, (yield read("mget", home_keys(agents))))
    workers, keys = alive_keys(homes)
    if not workers:
        return {}
    return live_homes(homes, workers, (yield read("mget", keys)))


def live_homes(homes: Mapping[str, str], workers: Sequence[str], beats: Sequence[Any]) -> dict[str, str]:
    """`homes` less those whose worker is gone (from an MGET of `alive_keys`)."""
    alive = {worker for worker, beat in zip(workers, beats, strict=True) if beat}
    return {agent: worker for agent, worker in homes.items() if worker in alive}


class JobWriter:
    """Enqueues kvrq jobs as rq does, into a pipeline (the blocking client's) or a Recorder (the asyncio
    client's, which then sends the recorded writes itself)."""

    def __init__(
        self, connection: Any, queue_name: str, default_job_timeout: int, *, recording: bool = False
    ) -> None:
        """`connection`: the redis-py client rq's Queue holds. `recording`: rq writes only into Recorders
        and reads nothing, so `connection` is never used (rq's one read, the server version, is preset:
        rq stamps it on the job object only, never in Redis)."""
        self.connection = connection
        self.queue_name = queue_name
        self.default_job_timeout = default_job_timeout
        self.recording = recording
        self._queues: dict[str, Queue] = {}

    def queue(self, name: str | None = None) -> Queue:
        name = name or self.queue_name
        if name not in self._queues:
            queue = Queue(name, connection=self.connection, serializer=SERIALIZER)
            if self.recording:
                queue.redis_server_version = _ASSUMED_SERVER_VERSION
            self._queues[name] = queue
        return self._queues[name]

    def enqueue(
        self, request: GenerationRequest, job_id: str | None, pipe: Any, homes: Mapping[str, str]
    ) -> str:
        """Write one job (hash, queue entry, the queue's registration) into `pipe`; returns its id."""
        retry = Retry(max=request.retries) if request.retries else None
        who = request.agent_id or "one-off"
        queue = request.queue or self.queue_name
        home = homes.get(request.agent_id) if request.agent_id is not None else None
        if home is not None:
            queue = worker_queue_name(queue, home)
        job = self.queue(queue).enqueue_call(
            JOB_FUNCTION,
            args=(request.job_payload(),),
            timeout=request.job_timeout or self.default_job_timeout,
            result_ttl=request.result_ttl,
            job_id=job_id,
            at_front=request.at_front,
            retry=retry,
            meta={"agent_id": request.agent_id},
            description=f"kvrq generate ({who}, max_tokens={request.max_tokens})",
            pipeline=pipe,
        )
        return str(job.id)
