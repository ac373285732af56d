"""`kvrq worker`: load the model, open the store, register with rq, run the loop until stopped.

The only module of the CLI that imports MLX (through engine.*), and only when called.
"""

from __future__ import annotations

import logging
import time

from redis import Redis

from producer.wire.redact import redact_url
from producer.wire.redis_url import REDIS_DOWN, connect
from worker.fleet.memory import return_large_frees_to_the_os
from worker.jobs.rqexec import KvrqWorker
from worker.loop.backoff import Backoff
from worker.loop.worker_loop import WorkerLoop
from worker.settings import WorkerSettings
from worker.warmup import (
    keep_buffers_for_returning_agents,
    read_returning_agents,
    returning_agents,
    warm_up,
)

log = logging.getLogger("kvrq.worker")
MiB = 1024 * 1024


def wait_for_redis(url: str) -> Redis:
    """A connection to `url`, waiting (with backoff) while Redis is not up yet."""
    connection = connect(url)
    backoff = Backoff()
    while True:
        try:
            connection.ping()
            return connection
        except REDIS_DOWN as exc:
            delay = backoff.next()
            log.warning("Redis at %s unreachable (%s): retry in %.1f s", redact_url(url), exc, delay)
            time.sleep(delay)


def serve(settings: WorkerSettings) -> int:
    from engine.batch.engine import BlockPoolBatchEngine
    from engine.models.load import load_model
    from store import open_store

    started = time.perf_counter()
    return_large_frees_to_the_os()
    model, tokenizer = load_model(settings.model)
    draft_model = None if settings.draft_model is None else load_model(settings.draft_model)[0]
    engine = BlockPoolBatchEngine(
        model,
        tokenizer,
        model_name=settings.model,
        pool_blocks=settings.pool_blocks,
        pool_mb=settings.pool_mb,
        max_batch=settings.max_batch,
        prefill_step_size=settings.prefill_step_size,
        prefill_tokens_per_step=settings.prefill_tokens_per_step,
        kv_bits=settings.kv_bits,
        kv_group_size=settings.kv_group_size,
        draft_model=draft_model,
        draft_model_name=settings.draft_model,
    )
    store = open_store(
        settings.store_uri(),
        engine.spec,
        hot_tier_bytes=int(settings.store_hot_mb * MiB),
        max_bytes=None if settings.store_max_mb is None else int(settings.store_max_mb * MiB),
        quantization=settings.store_quantization,
        connect=connect,
        namespace=settings.namespace,
        prefix_max_bytes=None if settings.prefix_cache_mb is None else int(settings.prefix_cache_mb * MiB),
    )
    log.info(
        "model %s loaded in %.1f s; store %s",
        settings.model,
        time.perf_counter() - started,
        redact_url(settings.store),
    )
    returning = []
    if settings.warmup:
        warm_up(engine)
        returning = returning_agents(store, settings.max_batch)
        keep_buffers_for_returning_agents(engine, returning)
    connection = wait_for_redis(settings.redis_url)
    if returning:
        read_returning_agents(
            connection,
            store,
            returning,
            budget_bytes=int(settings.store_hot_mb * MiB),
            bytes_per_token=engine.spec.bytes_per_token(),
        )
    rq_worker = KvrqWorker(
        settings.queue_names,
        connection=connection,
        name=settings.name,
        heartbeat_ttl=settings.heartbeat_ttl,
        default_result_ttl=settings.result_ttl,
        affinity=settings.affinity,
    )
    loop = WorkerLoop(
        engine=engine, store=store, rq_worker=rq_worker, settings=settings, model_name=settings.model
    )
    loop.install_signal_handlers()
    loop.start()
    if settings.metrics_port is not None:
        from worker.fleet.metrics import serve_metrics

        serve_metrics(loop, settings.metrics_port, settings.metrics_host)
        log.info("Prometheus metrics on http://%s:%d/metrics", settings.metrics_host, settings.metrics_port)
    try:
        return loop.run()
    finally:
        engine.close()
