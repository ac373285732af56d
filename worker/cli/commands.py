"""The client-side CLI commands: `kvrq generate`, `kvrq status`, `kvrq maintenance` (no MLX here)."""

from __future__ import annotations

import sys
import time
from datetime import datetime, timezone
from typing import IO, Any

from redis import Redis
from rq import Queue
from rq.executions import Execution
from rq.registry import StartedJobRegistry
from rq.worker import BaseWorker, Worker

from producer.client import JobFailedError, JobHandle, Producer, ResultTimeoutError
from producer.models import GenerationRequest, GenerationResult
from producer.protocol import SERIALIZER
from worker.maintenance import clean_queues


def workers_on(connection: Redis, queue: str) -> list[BaseWorker]:
    return [w for w in Worker.all(connection=connection, serializer=SERIALIZER) if queue in w.queue_names()]


def generate(
    redis_url: str,
    queue: str,
    request: GenerationRequest,
    *,
    timeout: float | None,
    out: IO[str] = sys.stdout,
    err: IO[str] = sys.stderr,
) -> int:
    """Enqueue one request, stream its text to `out`, then one line of figures to `err`."""
    with Producer(redis_url, queue) as producer:
        if not workers_on(producer.connection, request.queue or queue):
            print(
                f"(no kvrq worker listens on queue {request.queue or queue}: the job waits for one)", file=err
            )
        started = time.perf_counter()
        handle = producer.submit(request)
        first: float | None = None
        try:
            for text in handle.stream(timeout=timeout):
                if first is None:
                    first = time.perf_counter() - started
                out.write(text)
                out.flush()
            out.write("\n")
            result = handle.result(timeout=timeout)
        except KeyboardInterrupt:
            handle.cancel()
            print(f"\n(canceled job {handle.id})", file=err)
            return 130
        except JobFailedError as exc:
            print(f"\njob {handle.id} {exc.status}: {exc.reason}", file=err)
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
    connection = Redis.from_url(redis_url)
    names = queues or sorted(q.name for q in Queue.all(connection=connection, serializer=SERIALIZER))
    if not names:
        print("no queues yet", file=out)
    for name in names:
        queue = Queue(name, connection=connection, serializer=SERIALIZER)
        print(
            f"queue {name}: {queue.count} queued, {queue.started_job_registry.count} started, "
            f"{queue.finished_job_registry.count} finished, {queue.failed_job_registry.count} failed, "
            f"{queue.canceled_job_registry.count} canceled",
            file=out,
        )
    workers = Worker.all(connection=connection, serializer=SERIALIZER)
    if not workers:
        print("no workers", file=out)
    for worker in sorted(workers, key=lambda w: w.name):
        print(_worker_line(connection, worker), file=out)
    return 0


def _worker_line(connection: Redis, worker: BaseWorker) -> str:
    raw: Any = connection.hgetall(worker.key)
    extra = {_text(k): _text(v) for k, v in raw.items() if _text(k).startswith("kvrq_")}
    held = len(worker.get_current_executions(refresh=True))
    beat = worker.last_heartbeat
    ago = f"{(datetime.now(timezone.utc) - beat).total_seconds():.0f} s ago" if beat else "never"
    kind = (
        f"model {extra['kvrq_model']}, max_batch {extra.get('kvrq_max_batch')}"
        if extra
        else "plain rq worker"
    )
    return (
        f"worker {worker.name} ({worker.hostname}, pid {worker.pid}): {worker.get_state()}, {held} held, "
        f"queues {','.join(worker.queue_names())}, {kind}, last heartbeat {ago}"
    )


def maintenance(
    redis_url: str, queues: list[str] | None, dead_worker: str | None, out: IO[str] = sys.stdout
) -> int:
    connection = Redis.from_url(redis_url)
    names = queues or sorted(q.name for q in Queue.all(connection=connection, serializer=SERIALIZER))
    if dead_worker:
        expired = expire_worker_jobs(connection, dead_worker, names)
        print(f"worker {dead_worker}: {expired} started job(s) marked abandoned", file=out)
    report = clean_queues(connection, names)
    for name in names:
        if name in report.skipped:
            print(f"queue {name}: skipped, another process is cleaning it", file=out)
            continue
        abandoned, rescued = report.abandoned.get(name, []), report.rescued.get(name, [])
        print(
            f"queue {name}: {len(abandoned)} abandoned job(s) re-queued or failed, "
            f"{len(rescued)} stranded job(s) put back",
            file=out,
        )
        for job_id in abandoned:
            print(f"  {job_id}: {JobHandle(connection, job_id).status()}", file=out)
    return 0


def expire_worker_jobs(connection: Redis, worker_name: str, queues: list[str]) -> int:
    """Expire the heartbeats of a worker known to be dead, so cleanup handles its jobs now."""
    if connection.exists(Worker.redis_worker_namespace_prefix + worker_name):
        key = Worker.redis_worker_namespace_prefix + worker_name
        if not connection.hexists(key, "death"):
            print(
                f"warning: worker {worker_name} is still registered; its jobs are expired anyway",
                file=sys.stderr,
            )
    members = connection.smembers(f"rq:worker:{worker_name}:executions")
    count = 0
    for member in members:
        execution = Execution.from_composite_key(_text(member), connection)
        for name in queues:
            registry = StartedJobRegistry(name, connection=connection, serializer=SERIALIZER)
            changed: Any = connection.zadd(registry.key, {execution.composite_key: 1}, xx=True, ch=True)
            count += int(changed)
    return count


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
