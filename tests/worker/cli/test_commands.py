"""Client commands against fakeredis: generate (with a worker loop in a thread), status, maintenance."""

from __future__ import annotations

import io
import json
import re
import threading
import time
from collections.abc import Iterator

import pytest
from redis import Redis
from rq import Worker

from producer import client
from producer.client import Producer
from producer.models import GenerationRequest
from producer.wire import protocol as wire
from producer.wire.protocol import worker_alive_key
from tests.producer.fakes import fake_redis
from tests.worker.harness import Harness
from worker.cli import commands
from worker.fleet.latency import LatencyHistograms


def serve_fake(monkeypatch: pytest.MonkeyPatch, connection: Redis) -> None:
    """Every client the commands make from a URL (producer.wire.redis_url.connect) is `connection`."""
    for module in (commands, client):
        monkeypatch.setattr(module, "connect", lambda url, **kw: connection)


@pytest.fixture
def h(monkeypatch: pytest.MonkeyPatch) -> Iterator[Harness]:
    harness = Harness()
    # The commands open their own connections from a URL: hand them the harness's fake server.
    serve_fake(monkeypatch, harness.producer.connection)
    yield harness


def run_loop_in_background(h: Harness) -> threading.Event:
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            h.loop.run_once()
            time.sleep(0.001)

    threading.Thread(target=loop, daemon=True).start()
    return stop


def test_generate_streams_then_prints_figures(h: Harness) -> None:
    stop = run_loop_in_background(h)
    out, err = io.StringIO(), io.StringIO()
    request = GenerationRequest(agent_id="cli", prompt="hello", max_tokens=5)
    try:
        code = commands.generate("redis://fake", "kvrq", request, timeout=10, out=out, err=err)
    finally:
        stop.set()
    assert code == 0
    assert out.getvalue() == "abcde\n"
    assert "[length | 5 tokens | reused 0 of 5 prompt tokens from cache | first token" in err.getvalue()


def test_generate_reports_a_failed_job(h: Harness) -> None:
    stop = run_loop_in_background(h)
    out, err = io.StringIO(), io.StringIO()
    try:
        code = commands.generate(
            "redis://fake", "kvrq", GenerationRequest(prompt="BOOM"), timeout=10, out=out, err=err
        )
    finally:
        stop.set()
    assert code == 1
    # the code is the worker's ErrorCode for an engine failure (internal from a worker that records none)
    assert re.search(r"failed \((engine_error|internal)\): RuntimeError: kaboom in submit", err.getvalue())


def test_status_shows_queues_and_workers(h: Harness) -> None:
    Producer(connection=h.producer.connection).submit({"prompt": "x"})
    # what start() adds after register_birth()
    h.redis.hset(h.loop.worker.key, mapping=h.loop.upkeep.worker_fields())  # type: ignore[arg-type]
    out = io.StringIO()
    assert commands.status("redis://fake", None, out=out) == 0
    text = out.getvalue()
    assert "queue kvrq: 1 queued, 0 started, 0 finished, 0 failed, 0 canceled; 1 live worker(s)" in text
    assert f"worker {h.loop.worker.name}" in text and "max_batch 4)" in text and "model fake" in text


def test_status_shows_what_each_worker_holds_and_unserved_queues(monkeypatch: pytest.MonkeyPatch) -> None:
    connection = fake_redis()
    serve_fake(monkeypatch, connection)
    producer = Producer(connection=connection)
    for prompt in "abc":
        producer.submit({"prompt": prompt})
    producer.submit({"prompt": "d", "queue": "orphans"})
    kvrq = Worker(["kvrq"], name="kvrq-w1", connection=connection, serializer="json")
    kvrq.register_birth()
    fields = {
        wire.MODEL_FIELD: "smollm2-135m",
        wire.MAX_BATCH_FIELD: 16,
        wire.CAPACITY_FIELD: 32,
        wire.RUNNING_FIELD: 2,
    }
    fields |= {wire.WAITING_FIELD: 1, wire.POOL_BLOCKS_FIELD: 512, wire.FREE_BLOCKS_FIELD: 400}
    fields |= {
        wire.HOT_AGENTS_FIELD: 3,
        wire.CACHE_LOOKUPS_FIELD: 8,
        wire.HOT_HITS_FIELD: 4,
        wire.CACHE_HITS_FIELD: 6,
    }
    fields |= {wire.PROMPT_TOKENS_FIELD: 1000, wire.REUSED_TOKENS_FIELD: 900}
    fields |= {wire.MEMORY_FIELD: json.dumps({"rss": 1210.4, "mlx_active": 900.0, "hot_tier": 64.0})}
    latency = LatencyHistograms()
    for first_token in (0.3,) * 19 + (8.0,):
        latency.observe({"first_token": first_token, "total": 20.0}, outcome="finished", cache="hit")
    fields |= {wire.LATENCY_FIELD: latency.field()}
    connection.hset(kvrq.key, mapping=fields)  # type: ignore[arg-type]
    connection.set(worker_alive_key("kvrq-w1"), "1")  # its liveness beacon
    Worker(["kvrq"], name="plain-w2", connection=connection, serializer="json").register_birth()
    out = io.StringIO()
    assert commands.status("redis://fake", None, out=out) == 0
    lines = out.getvalue().splitlines()
    counts = "0 started, 0 finished, 0 failed, 0 canceled"
    assert f"queue kvrq: 3 queued, {counts}; 2 live worker(s) listen" in lines
    assert f"queue orphans: 1 queued, {counts}; no live worker listens" in lines
    kvrq_line = next(line for line in lines if line.startswith("worker kvrq-w1"))
    assert "holds 2 running + 1 waiting (capacity 32, max_batch 16), KV pool 400/512 blocks free" in kvrq_line
    assert "model smollm2-135m, 3 hot agent(s), cache hits 75% of 8 lookups (hot tier 50%)" in kvrq_line
    assert "prompt tokens reused 90%, queues kvrq, last heartbeat" in kvrq_line
    memory = lines[lines.index(kvrq_line) + 1]
    assert memory == "  memory: rss 1210 MB (hot tier 64, mlx active 900)"
    # histogram_quantile: rank 10 of 19 in (0.25, 0.5], rank 19 its top; ranks 10 and 19 of 20 in (10, 25]
    assert (
        lines[lines.index(kvrq_line) + 2] == "  latency p50/p95: first token 0.38/0.50 s, total 17.50/24.25 s"
    )
    plain_line = next(line for line in lines if line.startswith("worker plain-w2"))
    assert "plain rq worker, 0 execution(s)" in plain_line


def test_maintenance_with_a_dead_worker_handles_its_jobs_now(h: Harness) -> None:
    retried = h.producer.submit({"prompt": "x", "max_tokens": 1000, "retries": 1})
    lost = h.producer.submit({"prompt": "y", "max_tokens": 1000})
    h.loop.run_once()  # both started; then the worker "dies" (no more heartbeats)
    out = io.StringIO()
    assert commands.maintenance("redis://fake", ["kvrq"], h.loop.worker.name, out=out) == 0
    text = out.getvalue()
    assert f"worker {h.loop.worker.name}: declared dead" in text
    assert "queue kvrq: 2 job(s) of dead workers re-queued, 0 failed (crash budget spent)" in text
    assert (retried.status(), lost.status()) == ("queued", "queued")  # crash re-runs: retries not spent
