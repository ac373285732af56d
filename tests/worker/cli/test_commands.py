"""Client commands against fakeredis: generate (with a worker loop in a thread), status, maintenance."""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Iterator

import pytest
from redis import Redis

from producer.client import Producer
from producer.models import GenerationRequest
from tests.worker.test_loop import Harness
from worker.cli import commands


@pytest.fixture
def h(monkeypatch: pytest.MonkeyPatch) -> Iterator[Harness]:
    harness = Harness()
    # The commands open their own connections from a URL: hand them the harness's fake server.
    monkeypatch.setattr(Redis, "from_url", classmethod(lambda cls, url, **kw: harness.producer.connection))
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
    assert "failed: RuntimeError: kaboom in submit" in err.getvalue()


def test_status_shows_queues_and_workers(h: Harness) -> None:
    Producer(connection=h.producer.connection).submit({"prompt": "x"})
    h.redis.hset(
        h.loop.worker.key, mapping=h.loop.worker_fields()
    )  # what start() adds after register_birth()
    out = io.StringIO()
    assert commands.status("redis://fake", None, out=out) == 0
    text = out.getvalue()
    assert "queue kvrq: 1 queued, 0 started, 0 finished, 0 failed, 0 canceled" in text
    assert f"worker {h.loop.worker.name}" in text and "model fake, max_batch 4" in text


def test_maintenance_with_a_dead_worker_handles_its_jobs_now(h: Harness) -> None:
    retried = h.producer.submit({"prompt": "x", "max_tokens": 1000, "retries": 1})
    lost = h.producer.submit({"prompt": "y", "max_tokens": 1000})
    h.loop.run_once()  # both started; then the worker "dies" (no more heartbeats)
    out = io.StringIO()
    assert commands.maintenance("redis://fake", ["kvrq"], h.loop.worker.name, out=out) == 0
    text = out.getvalue()
    assert "2 started job(s) marked abandoned" in text
    assert "queue kvrq: 2 abandoned job(s) re-queued or failed" in text
    assert (retried.status(), lost.status()) == ("queued", "failed")
