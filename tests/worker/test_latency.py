"""Latency histograms: bucket counts, the worker-hash summary and the p50/p95 `kvrq status` prints."""

from __future__ import annotations

import json

import pytest

from worker.fleet.latency import HISTOGRAMS, LatencyHistograms, percentiles, quantile


def test_a_value_lands_in_the_first_bucket_whose_bound_is_not_below_it() -> None:
    latency = LatencyHistograms()
    bounds = HISTOGRAMS["total"].bounds
    for value in (0.1, 0.100001, 10_000.0):
        latency.observe({"total": value}, outcome="finished", cache="none")
    counts = latency.counts[("total", "finished", "none")]
    assert counts[bounds.index(0.1)] == 1 and counts[bounds.index(0.25)] == 1 and counts[-1] == 1
    assert latency.sums[("total", "finished", "none")] == pytest.approx(10_000.200001)


def test_quantiles_interpolate_inside_a_bucket_as_histogram_quantile_does() -> None:
    bounds = [1.0, 2.0, 4.0]
    assert quantile(0.5, bounds, [0, 10, 0, 0]) == pytest.approx(1.5)
    assert quantile(0.95, bounds, [10, 0, 10, 0]) == pytest.approx(2.0 + 2.0 * 0.9)
    assert quantile(0.5, bounds, [0, 0, 0, 3]) == 4.0  # in +Inf: the highest finite bound
    assert quantile(0.5, bounds, [0, 0, 0, 0]) is None


def test_the_worker_hash_field_sums_the_labels_and_gives_p50_p95() -> None:
    latency = LatencyHistograms()
    for index in range(20):
        latency.observe({"first_token": 0.3, "queue_wait": None}, outcome="finished", cache="hit")
        latency.observe({"first_token": 3.0}, outcome="failed" if index % 2 else "finished", cache="miss")
    field = json.loads(latency.field())
    assert set(field) == {"first_token"}  # nothing observed for the others
    assert sum(field["first_token"]["counts"]) == 40
    p50, p95 = percentiles(latency.field())["first_token"]
    assert 0.25 <= p50 <= 0.5 and 2.5 <= p95 <= 5.0


def test_an_unreadable_field_gives_no_percentiles() -> None:
    assert (
        percentiles(None) == {}
        and percentiles("not json") == {}
        and percentiles('{"x": {"bounds": 1}}') == {}
    )
