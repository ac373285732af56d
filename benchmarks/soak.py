"""Soak: thousands of agent turns through one `kvrq worker` whose hot tier and KV pool hold far
less than all the agents' caches. Does its memory stay bounded, and its per-job time flat?

    python benchmarks/soak.py                              # 2,000 jobs: 500 agents x 4 turns
    python benchmarks/soak.py --agents 150 --turns 4       # a shorter run

Every agent's turn k+1 extends its turn-k prompt (the conversation grows), so each turn resumes
from the cache the previous one saved: from the hot tier while the agent is still in it, else
from the disk store. All jobs are enqueued at once, turn after turn, and the worker takes them
in order. Sampled every `--sample` seconds: the worker's VmRSS (/proc/<pid>/status). Reported
per tenth of the jobs (by finishing order): RSS, jobs per second, and the median per-job engine
time (admission to result). Writes benchmarks/results/soak.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from redis import Redis  # noqa: E402

from benchmarks.common import machine, write_json  # noqa: E402
from benchmarks.procs import RedisProcess, WorkerProcess  # noqa: E402
from producer.client import JobFailedError, Producer  # noqa: E402
from producer.wire.protocol import MEMORY_FIELD  # noqa: E402

SYSTEM = "You are a ship's log keeper. Answer in a few words."
MiB = 1024 * 1024


def vm_rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class RssSampler(threading.Thread):
    """The worker's VmRSS every `every_s`, and the breakdown it publishes in its rq worker hash."""

    def __init__(self, pid: int, every_s: float, redis_url: str, worker_name: str) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.every_s = every_s
        self.samples: list[tuple[float, float]] = []  # (monotonic, MB)
        self.breakdowns: list[tuple[float, dict[str, float]]] = []  # (monotonic, MB by kind)
        self._connection = Redis.from_url(redis_url)
        self._key = f"rq:worker:{worker_name}"
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            rss = vm_rss_mb(self.pid)
            if rss is not None:
                self.samples.append((time.monotonic(), rss))
            published = self._connection.hget(self._key, MEMORY_FIELD)
            if published:
                self.breakdowns.append((time.monotonic(), json.loads(published)))
            self._halt.wait(self.every_s)

    def stop(self) -> None:
        self._halt.set()
        self.join()


def turn(agent: int, k: int, max_tokens: int) -> dict[str, Any]:
    messages = [{"role": "system", "content": SYSTEM}]
    for j in range(k + 1):
        messages.append({"role": "user", "content": f"Entry {j} for ship {agent}: wind and course?"})
    return {"agent_id": f"ship-{agent}", "messages": messages, "max_tokens": max_tokens}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--agents", type=int, default=500)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--hot-mb", type=float, default=64, help="worker hot tier (KVRQ_STORE_HOT_MB) [64]")
    parser.add_argument("--pool-blocks", type=int, default=32, help="KV pool, 256-token blocks [32]")
    parser.add_argument("--sample", type=float, default=2.0, help="seconds between RSS samples [2]")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "soak.json"))
    args = parser.parse_args(argv)
    jobs = args.agents * args.turns

    with tempfile.TemporaryDirectory(prefix="kvrq-soak-") as tmp:
        workdir = Path(tmp)
        redis = RedisProcess(workdir)
        redis.start()
        worker = WorkerProcess(
            redis.url,
            workdir,
            name="soak",
            args=["--pool-blocks", str(args.pool_blocks)],
            env={"KVRQ_STORE_HOT_MB": str(args.hot_mb), "KVRQ_HEARTBEAT_INTERVAL": "5"},
        )
        try:
            worker.start()
            assert worker.proc is not None
            sampler = RssSampler(worker.proc.pid, args.sample, redis.url, worker.name)
            sampler.start()
            time.sleep(args.sample)
            rss_idle = vm_rss_mb(worker.proc.pid)
            with Producer(redis.url, affinity=False) as producer:
                started = time.monotonic()
                handles = []
                for k in range(args.turns):
                    handles += producer.submit_many([turn(a, k, args.max_tokens) for a in range(args.agents)])
                print(f"{jobs} jobs enqueued; waiting", flush=True)
                finished: list[dict[str, Any]] = []
                failed = 0
                for index, handle in enumerate(handles):
                    try:
                        result = handle.result(timeout=3600)
                    except JobFailedError as exc:
                        failed += 1
                        print(f"job {handle.id} failed: {exc}", flush=True)
                        continue
                    enqueued = handle.job().enqueued_at
                    assert enqueued is not None
                    finished.append(
                        {
                            "turn": index // args.agents,
                            "done_at": enqueued.timestamp() + result.timings.total_s,
                            "engine_s": result.timings.total_s - result.timings.queued_s,
                            "reused": result.usage.reused_tokens,
                            "prompt": result.usage.prompt_tokens,
                        }
                    )
                    if (index + 1) % max(1, jobs // 10) == 0:
                        print(f"{index + 1}/{jobs} done, RSS {vm_rss_mb(worker.proc.pid)} MB", flush=True)
                wall = time.monotonic() - started
            sampler.stop()
            disk_mb = sum(f.stat().st_size for f in (workdir / "cache").rglob("*") if f.is_file()) / MiB
        finally:
            worker.stop()
            redis.stop()

    report = summarize(args, jobs, finished, failed, wall, sampler, rss_idle, disk_mb)
    out = write_json(args.out, report)
    print_report(report)
    print(f"\nwrote {out}")
    return 0


def summarize(
    args: argparse.Namespace,
    jobs: int,
    finished: list[dict[str, Any]],
    failed: int,
    wall: float,
    sampler: RssSampler,
    rss_idle: float | None,
    disk_mb: float,
) -> dict[str, Any]:
    samples = sampler.samples
    finished.sort(key=lambda f: f["done_at"])
    tenths = []
    size = max(1, len(finished) // 10)
    t0 = finished[0]["done_at"] - finished[0]["engine_s"] if finished else 0.0
    s0 = samples[0][0] if samples else 0.0
    wall_start = time.time() - (time.monotonic() - s0)  # unix time of the first RSS sample
    for i in range(0, len(finished), size):
        part = finished[i : i + size]
        start, end = part[0]["done_at"], part[-1]["done_at"]
        window = [mb for t, mb in samples if start <= wall_start + (t - s0) <= end]
        published = [b for t, b in sampler.breakdowns if start <= wall_start + (t - s0) <= end]
        tenths.append(
            {
                "jobs": f"{i + 1}-{i + len(part)}",
                "ended_at_s": round(end - t0, 1),
                "jobs_per_s": round(len(part) / max(end - start, 1e-6), 2),
                "engine_s_p50": round(statistics.median(f["engine_s"] for f in part), 3),
                "reused_share": round(
                    sum(f["reused"] for f in part) / max(1, sum(f["prompt"] for f in part)), 2
                ),
                "rss_mb_max": round(max(window), 0) if window else None,
                "breakdown_mb_last": published[-1] if published else None,
            }
        )
    rss = [mb for _, mb in samples]
    return {
        "command": " ".join(["python", "benchmarks/soak.py", *sys.argv[1:]]),
        "machine": machine(),
        "load_average_at_end": os.getloadavg(),
        "agents": args.agents,
        "turns": args.turns,
        "jobs": jobs,
        "finished": len(finished),
        "failed": failed,
        "wall_s": round(wall, 1),
        "hot_tier_mb": args.hot_mb,
        "pool_blocks": args.pool_blocks,
        "store_on_disk_mb": round(disk_mb, 0),
        "rss_mb_idle": rss_idle,
        "rss_mb_max": max(rss) if rss else None,
        "rss_mb_last": rss[-1] if rss else None,
        "tenths": tenths,
    }


def print_report(report: dict[str, Any]) -> None:
    print(
        f"\n{report['finished']}/{report['jobs']} jobs finished ({report['failed']} failed) "
        f"in {report['wall_s']} s; "
        f"hot tier {report['hot_tier_mb']} MB, pool {report['pool_blocks']} blocks, "
        f"store on disk {report['store_on_disk_mb']} MB"
    )
    print(f"worker RSS: idle {report['rss_mb_idle']:.0f} MB, max {report['rss_mb_max']:.0f} MB\n")
    print(
        "| jobs (finishing order) | ended at s | jobs/s | engine time p50 s | reused share | RSS max MB "
        "| worker's own breakdown, MB (last in the tenth) |"
    )
    print("|---|---|---|---|---|---|---|")
    for t in report["tenths"]:
        parts = t.get("breakdown_mb_last") or {}
        breakdown = ", ".join(f"{kind} {mb:.0f}" for kind, mb in sorted(parts.items()))
        print(
            f"| {t['jobs']} | {t['ended_at_s']} | {t['jobs_per_s']} | {t['engine_s_p50']} "
            f"| {t['reused_share']} | {t['rss_mb_max']} | {breakdown} |"
        )


if __name__ == "__main__":
    raise SystemExit(main())
