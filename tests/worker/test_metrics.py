"""The optional Prometheus endpoint: off unless asked, loopback, and what it exports."""

from __future__ import annotations

import urllib.request

from engine.batch.speculation import SpeculationStats
from tests.conftest import free_port
from tests.worker.harness import Harness
from worker.fleet.metrics import serve_metrics


def test_metrics_export_jobs_tokens_cache_and_queues() -> None:
    h = Harness()
    handles = [
        h.producer.submit({"agent_id": "A", "prompt": "hi" * (i + 1), "max_tokens": 3}) for i in range(2)
    ]
    queued = h.producer.submit({"prompt": "later", "max_tokens": 2})
    h.run_until(h.all_ended(handles))
    host, text = scrape(h)
    assert host == "127.0.0.1"
    me = f'worker="{h.loop.worker.name}"'
    assert f'kvrq_jobs_total{{outcome="finished",{me}}} {float(h.loop.counts["finished"])}' in text
    assert h.loop.counts["finished"] >= 2
    assert f"kvrq_generated_tokens_total{{{me}}} {float(h.loop.counts['tokens'])}" in text
    assert f"kvrq_reused_tokens_total{{{me}}} 2.0" in text  # the second turn reused its "hi"
    assert f"kvrq_cache_lookups_total{{{me}}}" in text and "kvrq_queue_depth" in text
    assert f"kvrq_draft_tokens_total{{{me}}} 0.0" in text, "speculation off: counted as none"
    assert queued.status() in ("queued", "started", "finished")


def test_metrics_export_the_engines_drafting_counts() -> None:
    h = Harness()
    h.loop.engine.drafting = SpeculationStats(steps=3, proposed=12, accepted=7)  # type: ignore[attr-defined]
    _, text = scrape(h)
    me = f'worker="{h.loop.worker.name}"'
    assert f"kvrq_drafting_steps_total{{{me}}} 3.0" in text
    assert f"kvrq_draft_tokens_total{{{me}}} 12.0" in text
    assert f"kvrq_accepted_draft_tokens_total{{{me}}} 7.0" in text


def test_the_worker_serves_no_metrics_unless_asked() -> None:
    assert Harness().settings.metrics_port is None


def test_metrics_export_per_job_latency_histograms_by_outcome_and_cache() -> None:
    h = Harness()
    first = h.producer.submit({"agent_id": "A", "prompt": "hi", "max_tokens": 3})
    h.run_until(h.all_ended([first]))
    second = h.producer.submit({"agent_id": "A", "prompt": "hi there", "max_tokens": 3})
    plain = h.producer.submit({"prompt": "no agent", "max_tokens": 2})
    h.run_until(h.all_ended([second, plain]))
    _, text = scrape(h)
    me = f'worker="{h.loop.worker.name}"'
    for name in (
        "kvrq_job_queue_wait_seconds",
        "kvrq_job_first_token_seconds",
        "kvrq_job_duration_seconds",
        "kvrq_job_tokens_per_second",
    ):
        for cache in ("hit", "miss", "none"):  # turn 2 resumed, turn 1 prefilled, the plain job has no agent
            assert f'{name}_count{{cache="{cache}",outcome="finished",{me}}} 1.0' in text, (name, cache)
        assert f'{name}_bucket{{cache="none",le="+Inf",outcome="finished",{me}}} 1.0' in text
    assert 'kvrq_job_cache_load_seconds_count{cache="hit",outcome="finished"' in text
    assert 'kvrq_job_cache_load_seconds_count{cache="none"' not in text  # no agent: no cache to load


def scrape(h: Harness) -> tuple[str, str]:
    """The address the metrics endpoint bound, and one scrape of it."""
    port = free_port()
    server = serve_metrics(h.loop, port)
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        return str(server.server_address[0]), text
    finally:
        server.shutdown()
