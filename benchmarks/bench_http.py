"""kvrq serve's own overhead per request: the same jobs through `Producer` and through HTTP.

    python benchmarks/bench_http.py                  # 300 requests a side, 2 rounds; writes results/http.json
    python benchmarks/bench_http.py --requests 50 --out /tmp/http.json

A private redis-server, a `kvrq serve` process and a stand-in worker (benchmarks/procs.py: it
answers each job at once with three deltas, in Redis as a kvrq worker does), so what is measured is
the path around the model, not the model. One client, one request at a time, each its own agent turn;
per side the client's time to the first text and to the end, p50 and p99: the producer side submits
with `Producer` and follows `JobHandle.stream()` then `result()`; the HTTP sides send streamed and
plain chat requests with the official `openai` client. The differences are the server's overhead (the
model's work per request is the same on every side, so it adds to all of them alike). Sides alternate
between rounds.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import openai  # noqa: E402

from benchmarks.common import machine, percentile, write_json  # noqa: E402
from benchmarks.procs import STAND_IN_MODEL as MODEL  # noqa: E402
from benchmarks.procs import stand_in_stack  # noqa: E402
from producer.client import Producer  # noqa: E402

Timed = tuple[float | None, float]  # (first text, end), seconds


def percentiles(values: list[float]) -> dict[str, float]:
    p50, p99 = percentile(values, 0.5), percentile(values, 0.99)
    assert p50 is not None and p99 is not None, "no timings"
    return {"p50_ms": round(1000 * p50, 2), "p99_ms": round(1000 * p99, 2)}


def sides(producer: Producer, client: openai.OpenAI) -> dict[str, Callable[[int], Timed]]:
    def producer_side(i: int) -> Timed:
        started = time.perf_counter()
        handle = producer.submit({"messages": [{"role": "user", "content": f"turn {i}"}], "agent_id": "a"})
        first = None
        for text in handle.stream(timeout=60):
            if first is None and text:
                first = time.perf_counter() - started
        handle.result(timeout=60)
        return first, time.perf_counter() - started

    def http_streamed(i: int) -> Timed:
        started = time.perf_counter()
        first = None
        for chunk in client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"turn {i}"}],
            stream=True,
            prompt_cache_key="b",
        ):
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - started
        return first, time.perf_counter() - started

    def http_plain(i: int) -> Timed:
        started = time.perf_counter()
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"turn {i}"}], prompt_cache_key="c"
        )
        took = time.perf_counter() - started
        return took, took

    return {"producer": producer_side, "http streamed": http_streamed, "http plain": http_plain}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=300, help="requests per side and round [300]")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "http.json"))
    args = parser.parse_args()
    report: dict[str, Any] = {
        "command": " ".join(["python", "benchmarks/bench_http.py", *sys.argv[1:]]),
        "machine": machine(),
        "load_average_before": os.getloadavg(),
        "rounds": [],
    }
    with (
        tempfile.TemporaryDirectory(prefix="kvrq-bench-http-") as tmp,
        stand_in_stack(Path(tmp)) as (server, _),
    ):
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        with Producer(server.redis_url) as producer:
            runners = sides(producer, client)
            for round_ in range(1, args.rounds + 1):
                order = list(runners) if round_ % 2 else list(runners)[::-1]
                for name in order:
                    runners[name](-1)  # connections, first request
                    timed = [runners[name](i) for i in range(args.requests)]
                    row = {
                        "round": round_,
                        "side": name,
                        "first": percentiles([first for first, _ in timed if first is not None]),
                        "end": percentiles([end for _, end in timed]),
                    }
                    report["rounds"].append(row)
                    print(f"round {round_}: {name}: first {row['first']}, end {row['end']}", flush=True)
    report["load_average_after"] = os.getloadavg()
    print("\n| round | side | first text p50 / p99 ms | end p50 / p99 ms |")
    print("|---|---|---|---|")
    for row in report["rounds"]:
        first, end = row["first"], row["end"]
        print(
            f"| {row['round']} | {row['side']} | {first['p50_ms']:.1f} / {first['p99_ms']:.1f} "
            f"| {end['p50_ms']:.1f} / {end['p99_ms']:.1f} |"
        )
    print(f"\nwrote {write_json(args.out, report)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
