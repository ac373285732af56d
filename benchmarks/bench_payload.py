"""What an oversized payload costs a worker before it is rejected: loading the rq job and validating it.

Run: .venv/bin/python benchmarks/bench_payload.py [--redis-url redis://127.0.0.1:6379/0] [--repeat 3]
Enqueues plain-rq jobs into a queue of its own (deleted after), then loads each the way rq's stock
Job class does and the way a kvrq worker does (worker.job_data.BoundedJob), and validates it
(worker.jobs.request_from_job): median wall time and peak Python memory (tracemalloc) per case.
Nothing reaches a tokenizer. Writes benchmarks/results/payload.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import tracemalloc
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from redis import Redis  # noqa: E402
from rq import Queue  # noqa: E402
from rq.job import Job  # noqa: E402
from rq.serializers import JSONSerializer  # noqa: E402

from producer.models import MAX_PROMPT_CHARS  # noqa: E402
from producer.wire.protocol import JOB_FUNCTION  # noqa: E402
from worker.job_data import BoundedJob  # noqa: E402
from worker.jobs import JobRejected, request_from_job  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "payload.json"
CASES: dict[str, dict[str, Any]] = {
    "largest valid prompt (1M chars)": {"prompt": "a" * MAX_PROMPT_CHARS, "max_tokens": 1},
    "10 MB prompt": {"prompt": "a" * 10_000_000},
    "3 x 900k-char messages": {"messages": [{"role": "user", "content": "b" * 900_000}] * 3},
    "200 MB prompt (190 KB in Redis)": {"prompt": "a" * 200_000_000},
}


def load_and_validate(connection: Redis, job_id: str, job_class: type[Job]) -> tuple[float, int, str]:
    """Seconds and peak bytes to fetch the job with `job_class` and validate it; the verdict."""
    tracemalloc.start()
    started = time.perf_counter()
    job = job_class.fetch(job_id, connection=connection, serializer=JSONSerializer)
    try:
        request_from_job(job)
        verdict = "accepted"
    except JobRejected as exc:
        verdict = str(exc)
    elapsed = time.perf_counter() - started
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return elapsed, peak, verdict


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    connection = Redis.from_url(args.redis_url)
    queue = Queue(f"bench-payload-{uuid.uuid4().hex[:8]}", connection=connection, serializer=JSONSerializer)
    rows = []
    try:
        for name, payload in CASES.items():
            job = queue.enqueue(JOB_FUNCTION, payload)
            stored = len(connection.hget(job.key, "data") or b"")
            row: dict[str, Any] = {"case": name, "stored_bytes": stored}
            for label, job_class in (("rq", Job), ("kvrq", BoundedJob)):
                runs = [load_and_validate(connection, job.id, job_class) for _ in range(args.repeat)]
                row[f"{label}_s"] = statistics.median(r[0] for r in runs)
                row[f"{label}_peak_mb"] = max(r[1] for r in runs) / 1e6
                row[f"{label}_verdict"] = runs[0][2]
            rows.append(row)
            job.delete()
    finally:
        for key in connection.scan_iter(f"{queue.key}*"):
            connection.delete(key)
    print("| payload | in Redis | rq Job: load + validate | peak | kvrq BoundedJob: load + validate | peak | "
          "time ratio kvrq / rq | kvrq verdict |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['case']} | {row['stored_bytes'] / 1e3:,.0f} KB | {row['rq_s'] * 1e3:,.0f} ms | "
            f"{row['rq_peak_mb']:,.0f} MB | {row['kvrq_s'] * 1e3:,.0f} ms | {row['kvrq_peak_mb']:,.0f} MB | "
            f"{row['kvrq_s'] / row['rq_s']:.2f} | {row['kvrq_verdict'][:70]} |"
        )
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"repeat": args.repeat, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
