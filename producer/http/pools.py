"""Which models the live workers serve, and on which queue: a request's `model` picks its pool.

Each kvrq worker writes the model it runs into its rq worker hash (protocol.MODEL_FIELD) and listens
on its shared queue(s) plus a queue of its own (affinity); a pool is the live workers of one model,
and its queue is the shared queue they listen on (`kvrq` where they listen on several).

A Redis failover's write pause (Sentinel: until the old primary rejoins, 15-30 s) outlasts a worker's
liveness key (10 s): its workers look gone although they are still registered with rq and come back
as soon as writes resume. A model seen live within LAPSED_GRACE_S whose workers are registered but
lapsed is therefore still served (its requests wait for them) rather than answered 503; workers that
left (unregistered) or lapsed for longer get the 503.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass

from redis import Redis
from rq import Worker
from rq.worker import BaseWorker

from producer.http.errors import APIError
from producer.liveness import alive, all_live_workers
from producer.wire.protocol import CONTEXT_FIELD, DEFAULT_QUEUE, MODEL_FIELD, SERIALIZER, shared_queue_of
from producer.wire.redis_url import FAILOVER_BUDGET_S

#: Seconds a reading of the pools is reused (each reading lists the workers: a few Redis round trips).
POOLS_TTL_S = 1.0
#: Retry-After (seconds) when a model's workers are all gone: a worker restarting takes about this long.
RETRY_AFTER_S = 5
#: Seconds after a model was last seen live during which its registered, lapsed workers still serve it.
LAPSED_GRACE_S = FAILOVER_BUDGET_S


@dataclass(frozen=True)
class Pool:
    model: str
    queue: str
    workers: int
    #: The smallest context length (tokens) its workers publish; None where none does (an older worker).
    context: int | None = None


def served_pools(connection: Redis) -> dict[str, Pool]:
    """model -> its pool, for every model at least one live kvrq worker runs."""
    workers = all_live_workers(connection)
    queues: dict[str, Counter[str]] = {}
    counts: Counter[str] = Counter()
    contexts: dict[str, int] = {}
    for worker, model, context in zip(
        workers, _models_of(connection, workers), _contexts_of(connection, workers), strict=True
    ):
        if model is None:
            continue  # a plain rq worker: it serves no model of ours
        counts[model] += 1
        queues.setdefault(model, Counter()).update({shared_queue_of(q) for q in worker.queue_names()})
        if context is not None:
            contexts[model] = min(context, contexts.get(model, context))
    return {
        model: Pool(model, _queue_of(queues[model]), counts[model], contexts.get(model))
        for model in sorted(counts)
    }


def lapsed_models(connection: Redis) -> set[str]:
    """Models of kvrq workers still registered with rq whose liveness key is gone."""
    registered = Worker.all(connection=connection, serializer=SERIALIZER)
    live = {worker.name for worker in alive(connection, registered)}
    lapsed = [worker for worker in registered if worker.name not in live]
    return {model for model in _models_of(connection, lapsed) if model is not None}


def _models_of(connection: Redis, workers: list[BaseWorker]) -> list[str | None]:
    """The model each worker runs (None: a plain rq worker), in one round trip."""
    return _hash_field(connection, workers, MODEL_FIELD)


def _contexts_of(connection: Redis, workers: list[BaseWorker]) -> list[int | None]:
    """The context length each worker publishes (None: none, or not a number), in one round trip."""
    texts = _hash_field(connection, workers, CONTEXT_FIELD)
    return [int(text) if text is not None and text.isdigit() else None for text in texts]


def _hash_field(connection: Redis, workers: list[BaseWorker], name: str) -> list[str | None]:
    """One field of each worker's rq hash (None where it is missing or empty), in one round trip."""
    if not workers:
        return []
    with connection.pipeline(transaction=False) as pipe:
        for worker in workers:
            pipe.hget(worker.key, name)
        values = pipe.execute()
    return [None if not raw else raw.decode() if isinstance(raw, bytes) else str(raw) for raw in values]


def _queue_of(queues: Counter[str]) -> str:
    """The pool's queue: the default one where its workers listen there, else the one most of them do."""
    if DEFAULT_QUEUE in queues:
        return DEFAULT_QUEUE
    return sorted(queues, key=lambda name: (-queues[name], name))[0]


class PoolDirectory:
    """The pools, read at most every POOLS_TTL_S; remembers the models it has seen served, so a model
    whose workers are all gone for now gets 503 (come back) rather than 404 (never served here)."""

    def __init__(self, connection: Redis, *, ttl_s: float = POOLS_TTL_S) -> None:
        self.connection = connection
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._read_at = float("-inf")
        self._pools: dict[str, Pool] = {}
        self._live_at: dict[str, tuple[Pool, float]] = {}  # every model seen live: its pool then, when

    def pools(self) -> dict[str, Pool]:
        with self._lock:
            if time.monotonic() - self._read_at >= self.ttl_s:
                self._pools = served_pools(self.connection)
                self._read_at = time.monotonic()
                self._live_at.update({model: (pool, self._read_at) for model, pool in self._pools.items()})
            return dict(self._pools)

    def resolve(self, model: str | None) -> Pool:
        """The pool serving `model` (None: the only model served), or the APIError to answer."""
        pools = self.pools()
        if model is not None and model in pools:
            return pools[model]
        if not pools or (model is not None and model in self._live_at):
            lapsed = self._lapsed(model)
            if lapsed is not None:
                return lapsed
            what = "any model" if model is None else f"model {model!r}"
            raise APIError(
                503,
                f"no live worker serves {what} right now; start one (kvrq worker) or retry later",
                code="no_worker",
                retry_after=RETRY_AFTER_S,
            )
        served = ", ".join(sorted(pools))
        if model is None:
            if len(pools) == 1:
                return next(iter(pools.values()))
            raise APIError(400, f"name a model: the live workers serve {served}", code="model_required")
        raise APIError(
            404,
            f"the model {model!r} is not served here; the live workers serve: {served}",
            code="model_not_found",
            param="model",
        )

    def _lapsed(self, model: str | None) -> Pool | None:
        """The pool of `model` (None: the one model seen lately) if it was live within LAPSED_GRACE_S
        and its workers are registered but lapsed (a failover's write pause), else None."""
        now = time.monotonic()
        recent = {m: pool for m, (pool, at) in self._live_at.items() if now - at <= LAPSED_GRACE_S}
        if model is None and len(recent) == 1:
            model = next(iter(recent))
        if model not in recent or model not in lapsed_models(self.connection):
            return None
        return recent[model]
