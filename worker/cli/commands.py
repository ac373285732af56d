"""The client-side CLI commands: `kvrq generate`, `kvrq status`, `kvrq maintenance` (no MLX here)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import IO, Any

from redis import Redis
from rq import Queue
from rq.worker import BaseWorker, Worker

from producer.client import JobFailedError, JobHandle, Producer, ResultTimeoutError
from producer.liveness import WorkerWatch, live_workers
from producer.models import GenerationRequest, GenerationResult
from producer.wire import protocol as wire
from producer.wire.protocol import SERIALIZER, worker_alive_key
from producer.wire.redis_url import connect
from producer.wire.text import as_text
from worker.fleet.latency import percentiles
from worker.fleet.maintenance import clean_queues


def generate(
    redis_url: str,
    queue: str,
    request: GenerationRequest,
    *,
    timeout: float | None,
    out: IO[str] = sys.stdout,
    err: IO[str] = sys.stderr,
) -> int:
    """Enqueue one request, stream its text to `out`, then one line of figures to `err`.

    While the job waits in a queue no live worker listens on, says so on `err` after a few seconds.
    """
    with Producer(redis_url, queue) as producer:
        started = time.perf_counter()
        handle = producer.submit(request)
        watch = WorkerWatch(
            producer.connection, request.queue or queue, lambda text: print(f"({text})", file=err)
        )
        first: float | None = None
        try:
            for text in handle.stream(timeout=timeout, on_wait=watch.check):
                if first is None:
                    first = time.perf_counter() - started
                out.write(text)
                out.flush()
            out.write("\n")
            result = handle.result(timeout=timeout, on_wait=watch.check)
        except KeyboardInterrupt:
            handle.cancel()
            print(f"\n(canceled job {handle.id})", file=err)
            return 130
        except JobFailedError as exc:
            print(f"\njob {handle.id} {exc.status} ({exc.code}): {exc.reason}", file=err)
            return 1
        except ResultTimeoutError as exc:
            print(f"\n{exc}", file=err)
            return 1
    print(summary_line(result, first), file=err)
    return 0


def summary_line(result: GenerationResult, client_ttft: float | None = None) -> str:
    usage, timings = result.usage, result.timings
    ttft = client_ttft if client_ttft is not None else timings.time_to_first_token_s
    ttft_text = "-" if ttft is None else f"{ttft:.2f} s"
    return (
        f"[{result.finish_reason} | {usage.generated_tokens} tokens | reused {usage.reused_tokens} "
        f"of {usage.prompt_tokens} prompt tokens from cache | first token {ttft_text} | "
        f"total {timings.total_s:.2f} s]"
    )


def status(redis_url: str, queues: list[str] | None, out: IO[str] = sys.stdout) -> int:
    """Per queue its depth by registry and how many live workers listen; per worker what it holds."""
    connection = connect(redis_url)
    names = queues or sorted(q.name for q in Queue.all(connection=connection, serializer=SERIALIZER))
    if not names:
        print("no queues yet", file=out)
    for name in names:
        queue = Queue(name, connection=connection, serializer=SERIALIZER)
        listening = len(live_workers(connection, name))
        print(
            f"queue {name}: {queue.count} queued, {queue.started_job_registry.count} started, "
            f"{queue.finished_job_registry.count} finished, {queue.failed_job_registry.count} failed, "
            f"{queue.canceled_job_registry.count} canceled; "
            + (f"{listening} live worker(s) listen" if listening else "no live worker listens"),
            file=out,
        )
    workers = Worker.all(connection=connection, serializer=SERIALIZER)
    if not workers:
        print("no workers", file=out)
    for worker in sorted(workers, key=lambda w: w.name):
        print("\n".join(worker_lines(connection, worker)), file=out)
    return 0


#: Job ids `kvrq status` lists per worker; more are counted, not listed.
MAX_LISTED_JOBS = 8


def worker_lines(connection: Redis, worker: BaseWorker) -> list[str]:
    """A worker's state and what it holds: kvrq's fields in its rq worker hash, and its rq executions."""
    raw: Any = connection.hgetall(worker.key)
    fields = {as_text(k): as_text(v) for k, v in raw.items()}
    job_ids = [execution.job_id for execution in worker.get_current_executions(refresh=True)]
    beat = worker.last_heartbeat
    ago = f"{(datetime.now(timezone.utc) - beat).total_seconds():.0f} s ago" if beat else "never"
    if wire.MODEL_FIELD in fields:
        running, waiting, capacity, max_batch, free, pool = (
            fields.get(name, "?")
            for name in (
                wire.RUNNING_FIELD,
                wire.WAITING_FIELD,
                wire.CAPACITY_FIELD,
                wire.MAX_BATCH_FIELD,
                wire.FREE_BLOCKS_FIELD,
                wire.POOL_BLOCKS_FIELD,
            )
        )
        holds = (
            f"holds {running} running + {waiting} waiting (capacity {capacity}, max_batch {max_batch}), "
            f"KV pool {free}/{pool} blocks free, model {fields[wire.MODEL_FIELD]}, {cache_line(fields)}"
        )
    else:
        holds = f"plain rq worker, {len(job_ids)} execution(s)"
    lines = [
        f"worker {worker.name} ({worker.hostname}, pid {worker.pid}): {worker.get_state()}, {holds}, "
        f"queues {','.join(worker.queue_names())}, last heartbeat {ago}"
    ]
    if fields.get(wire.MEMORY_FIELD):
        lines.append(f"  memory: {memory_line(fields[wire.MEMORY_FIELD])}")
    if latency := latency_line(fields.get(wire.LATENCY_FIELD)):
        lines.append(f"  latency p50/p95: {latency}")
    if job_ids:
        listed = ", ".join(job_ids[:MAX_LISTED_JOBS])
        more = f" (+{len(job_ids) - MAX_LISTED_JOBS} more)" if len(job_ids) > MAX_LISTED_JOBS else ""
        lines.append(f"  jobs: {listed}{more}")
    return lines


#: How `kvrq status` names each latency histogram, and its unit.
LATENCY_LABELS = {
    "queue_wait": ("queue wait", "s"),
    "cache_load": ("cache load", "s"),
    "first_token": ("first token", "s"),
    "total": ("total", "s"),
    "tokens_per_second": ("per job", "tokens/s"),
}


def latency_line(field: str | None) -> str:
    """`queue wait 0.12/0.80 s, first token ...` from a worker's latency histograms ('' without jobs)."""
    found = percentiles(field)
    return ", ".join(
        f"{label} {found[key][0]:.2f}/{found[key][1]:.2f} {unit}"
        for key, (label, unit) in LATENCY_LABELS.items()
        if key in found
    )


def memory_line(field: str) -> str:
    """`rss 1200 MB (MLX active 900, ...)` from the worker hash's JSON of MB by kind."""
    try:
        figures = json.loads(field)
        rss = figures.pop("rss")
        parts = ", ".join(f"{kind.replace('_', ' ')} {mb:.0f}" for kind, mb in sorted(figures.items()))
    except (ValueError, TypeError, KeyError, AttributeError):
        return "unreadable"
    return f"rss {rss:.0f} MB ({parts})"


def cache_line(fields: Mapping[str, str | None]) -> str:
    """Hot agents, cache hit rates and reused prompt tokens, from a kvrq worker's hash."""

    def number(field: str) -> int:
        value = fields.get(field)
        return int(value) if value and value.isdigit() else 0

    lookups, prompt = number(wire.CACHE_LOOKUPS_FIELD), number(wire.PROMPT_TOKENS_FIELD)
    hot = f"{number(wire.HOT_HITS_FIELD) / lookups:.0%}" if lookups else "-"
    cache = f"{number(wire.CACHE_HITS_FIELD) / lookups:.0%}" if lookups else "-"
    reused = f"{number(wire.REUSED_TOKENS_FIELD) / prompt:.0%}" if prompt else "-"
    return (
        f"{number(wire.HOT_AGENTS_FIELD)} hot agent(s), cache hits {cache} of {lookups} lookups "
        f"(hot tier {hot}), prompt tokens reused {reused}"
    )


def maintenance(
    redis_url: str, queues: list[str] | None, dead_worker: str | None, out: IO[str] = sys.stdout
) -> int:
    connection = connect(redis_url)
    names = queues or sorted(q.name for q in Queue.all(connection=connection, serializer=SERIALIZER))
    if dead_worker:
        declare_dead(connection, dead_worker)
        print(f"worker {dead_worker}: declared dead", file=out)
    report = clean_queues(connection, names)
    for name in names:
        if name in report.skipped:
            print(f"queue {name}: skipped, another process is cleaning it", file=out)
            continue
        handled = report.rerun.get(name, []) + report.crashed.get(name, []) + report.abandoned.get(name, [])
        print(
            f"queue {name}: {len(report.rerun.get(name, []))} job(s) of dead workers re-queued, "
            f"{len(report.crashed.get(name, []))} failed (crash budget spent), "
            f"{len(report.abandoned.get(name, []))} abandoned, "
            f"{len(report.rescued.get(name, []))} stranded job(s) put back",
            file=out,
        )
        for job_id in handled:
            print(f"  {job_id}: {JobHandle(connection, job_id).status()}", file=out)
    return 0


def declare_dead(connection: Redis, worker_name: str) -> None:
    """Take an operator's word that a worker is dead: its liveness key goes, so its jobs re-run now."""
    key = Worker.redis_worker_namespace_prefix + worker_name
    if connection.exists(key) and not connection.hexists(key, "death"):
        print(
            f"warning: worker {worker_name} is still registered; its jobs are re-run anyway", file=sys.stderr
        )
    connection.delete(worker_alive_key(worker_name))
