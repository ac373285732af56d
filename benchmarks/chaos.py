"""Chaos benchmark: faults against real `kvrq worker` processes, and what each costs.

    python benchmarks/chaos.py                       # every fault, 20 rounds each (hours here)
    python benchmarks/chaos.py --rounds 2            # the same, 2 rounds each
    python benchmarks/chaos.py --only kill9-peer --rounds 5   # replaces that row in the JSON

Faults (each round submits `--jobs` jobs, waits until they run, then strikes):
- kill9-peer: `kill -9` of the worker holding the most jobs while a second worker is alive
  (default liveness settings: 10 s TTL, 5 s crash check); a replacement starts after the round;
- kill9-peer-fast: the same with KVRQ_LIVENESS_TTL=2, KVRQ_CRASH_CHECK_INTERVAL=1;
- kill9-alone: `kill -9` of the only worker, a new one started right away (its model load is
  part of the recovery), default liveness;
- kill9-puts-disk / kill9-puts-redis: agents' jobs finishing at staggered times (their caches
  being written behind), `kill -9` of the worker holding most of them as the first result lands;
  the survivor re-runs the rest, then every agent's next turn runs (a corrupt cache would fail
  or mis-resume it);
- redis-restart: Redis (AOF, fsync always) stopped with SIGTERM and started again mid-batch;
- redis-outage: Redis gone for `--outage` seconds (30 by default) mid-batch.

Per fault: jobs finished / failed / lost (never ended) / duplicated (more than one rq Result,
or a stream closed twice), and recovery p50 / p95: seconds from the strike to each affected job
being re-queued (its worker's execution gone) and to it finishing. Prints a markdown table and
writes benchmarks/results/chaos.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from redis import Redis  # noqa: E402

from benchmarks.chaos_checks import ENDED, Delivery, deliveries, summary  # noqa: E402
from benchmarks.common import machine, percentile  # noqa: E402
from benchmarks.procs import RedisProcess, WorkerProcess, wait_for  # noqa: E402
from producer.client import JobHandle, Producer  # noqa: E402

FAST_LIVENESS = {"KVRQ_LIVENESS_TTL": "2", "KVRQ_CRASH_CHECK_INTERVAL": "1"}
STORY = "Once upon a time, in a small village by the sea,"
SYSTEM = (
    "You are the harbour master of a small fishing town. You know every boat, its crew and its "
    "catch, and you answer in one or two friendly sentences."
)
FAULTS = (
    "kill9-peer",
    "kill9-peer-fast",
    "kill9-alone",
    "kill9-puts-disk",
    "kill9-puts-redis",
    "redis-restart",
    "redis-outage",
)
POLL_S = 0.05


@dataclass
class FaultResult:
    fault: str
    rounds: int = 0
    deliveries: list[Delivery] = field(default_factory=list)
    requeued_s: list[float] = field(default_factory=list)  # strike -> re-queued, per affected job
    finished_s: list[float] = field(default_factory=list)  # strike -> finished, per affected job
    notes: list[str] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        return {
            "fault": self.fault,
            "rounds": self.rounds,
            **summary(self.deliveries),
            "jobs": len(self.deliveries),
            "requeued_p50_s": percentile(self.requeued_s, 0.5),
            "requeued_p95_s": percentile(self.requeued_s, 0.95),
            "finished_p50_s": percentile(self.finished_s, 0.5),
            "finished_p95_s": percentile(self.finished_s, 0.95),
            "affected_jobs": len(self.finished_s),
            "notes": self.notes,
        }


class Bench:
    """One redis-server (AOF) and the workers of one fault, in a scratch directory."""

    def __init__(self, workdir: Path, store: str) -> None:
        self.workdir = workdir
        self.store = store
        self.redis = RedisProcess(workdir, persistent=True)
        self.redis.start()
        self.connection = Redis.from_url(self.redis.url)
        self.producer = Producer(self.redis.url, affinity=False)
        self.workers: list[WorkerProcess] = []

    def start_worker(self, env: dict[str, str] | None = None) -> WorkerProcess:
        args = ["--store", "redis"] if self.store == "redis" else []
        worker = WorkerProcess(
            self.redis.url, self.workdir, name=f"chaos-{len(self.workers) + 1}", args=args, env=env
        )
        self.workers.append(worker)
        return worker.start()

    def close(self) -> None:
        for worker in self.workers:
            worker.stop()
        self.producer.close()
        self.redis.stop()


def holder(connection: Redis, job_id: str) -> str | None:
    status, name = (_text(v) for v in connection.hmget(f"rq:job:{job_id}", ["status", "worker_name"]))
    return name if status == "started" and name else None


def status_of(connection: Redis, job_id: str) -> str:
    return _text(connection.hget(f"rq:job:{job_id}", "status")) or "gone"


def _text(value: Any) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


def watch(
    connection: Redis, handles: list[JobHandle], since: float, victim: str | None, timeout: float
) -> tuple[dict[str, float], dict[str, float]]:
    """Poll until every job ended: when each left the victim (re-queued) and when each finished."""
    requeued: dict[str, float] = {}
    finished: dict[str, float] = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pending = False
        for handle in handles:
            if handle.id in finished:
                continue
            status = status_of(connection, handle.id)
            if victim is not None and handle.id not in requeued and holder(connection, handle.id) != victim:
                requeued[handle.id] = time.monotonic() - since
            if status in ENDED:
                finished[handle.id] = time.monotonic() - since
            else:
                pending = True
        if not pending:
            break
        time.sleep(POLL_S)
    return requeued, finished


def story_jobs(n: int, max_tokens: int) -> list[dict[str, Any]]:
    return [{"prompt": f"{STORY} ({i})", "max_tokens": max_tokens} for i in range(n)]


def agent_turn(agent: str, max_tokens: int, follow_up: str | None = None) -> dict[str, Any]:
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Which boat came in first this morning?"},
    ]
    if follow_up is not None:
        messages += [{"role": "user", "content": follow_up}]
    return {"agent_id": agent, "messages": messages, "max_tokens": max_tokens}


def wait_running(bench: Bench, handles: list[JobHandle], timeout: float = 180) -> None:
    """Until no job is queued any more (each started, or already ended) and one has streamed a token."""
    connection = bench.connection

    def running() -> bool:
        taken = all(status_of(connection, h.id) in ("started", *ENDED) for h in handles)
        return taken and any(connection.xlen(f"kvrq:stream:{h.id}") > 1 for h in handles)

    wait_for(running, timeout, "the jobs did not start", interval=POLL_S)


def busiest(bench: Bench, handles: list[JobHandle], alive: list[WorkerProcess]) -> WorkerProcess:
    counts = {w.name: 0 for w in alive}
    for handle in handles:
        name = holder(bench.connection, handle.id)
        if name in counts:
            counts[name] += 1
    return max(alive, key=lambda w: counts[w.name])


def kill_round(
    bench: Bench,
    result: FaultResult,
    alive: list[WorkerProcess],
    jobs: int,
    env: dict[str, str] | None,
    *,
    peer: bool,
) -> list[WorkerProcess]:
    handles = bench.producer.submit_many(story_jobs(jobs, 24))
    wait_running(bench, handles)
    victim = busiest(bench, handles, alive)
    affected = [h for h in handles if holder(bench.connection, h.id) == victim.name]
    wait_for(  # strike while the victim's own jobs are streaming, so their re-runs continue streams
        lambda: any(bench.connection.xlen(f"kvrq:stream:{h.id}") > 1 for h in affected),
        120,
        "the victim's jobs streamed nothing",
        interval=POLL_S,
    )
    struck = time.monotonic()
    victim.kill()
    alive = [w for w in alive if w is not victim]
    if not peer:
        alive.append(bench.start_worker(env))  # recovery includes its start
    record_reruns(bench, result, handles, affected, struck, victim.name)
    result.notes.append(f"{len(affected)} of {jobs} jobs held by the killed worker")
    if peer:
        alive.append(bench.start_worker(env))  # back to two workers for the next round
    return alive


def record_reruns(
    bench: Bench,
    result: FaultResult,
    handles: list[JobHandle],
    affected: list[JobHandle],
    struck: float,
    victim: str,
) -> None:
    """Once every job ended: each delivery, and for the killed worker's jobs that ran again, how long
    after the strike each went back to the queue and finished."""
    requeued, finished = watch(bench.connection, handles, struck, victim, timeout=600)
    delivered = deliveries(handles)
    rerun = {d.job_id for d in delivered if d.crashes > 0}
    result.requeued_s += [requeued[h.id] for h in affected if h.id in rerun and h.id in requeued]
    result.finished_s += [finished[h.id] for h in affected if h.id in rerun and h.id in finished]
    result.deliveries += delivered


def puts_round(
    bench: Bench, result: FaultResult, alive: list[WorkerProcess], round_: int
) -> list[WorkerProcess]:
    agents = [f"r{round_}-agent-{i}" for i in range(16)]
    handles = bench.producer.submit_many(
        [agent_turn(agent, 4 + 2 * i) for i, agent in enumerate(agents)]
    )  # staggered ends: caches written behind one after another
    wait_running(bench, handles)
    victim = busiest(bench, handles, alive)
    affected = [h for h in handles if holder(bench.connection, h.id) == victim.name]
    wait_for(
        lambda: any(status_of(bench.connection, h.id) == "finished" for h in affected),
        300,
        "no result came",
        interval=0.01,
    )
    struck = time.monotonic()
    victim.kill()
    alive = [w for w in alive if w is not victim]
    record_reruns(bench, result, handles, affected, struck, victim.name)
    nexts = bench.producer.submit_many([agent_turn(agent, 4, "And the second?") for agent in agents])
    watch(bench.connection, nexts, time.monotonic(), None, timeout=600)
    next_turns = deliveries(nexts)
    result.deliveries += next_turns
    reused = [h.result(timeout=5).usage.reused_tokens for h in nexts if h.status() == "finished"]
    result.notes.append(
        f"killed as the first of its {len(affected)} results landed; next turns: "
        f"{sum(d.finished_once for d in next_turns)}/{len(nexts)} finished, "
        f"{sum(r > 0 for r in reused)} resumed from a saved cache"
    )
    alive.append(bench.start_worker())
    return alive


def redis_round(bench: Bench, result: FaultResult, jobs: int, down_s: float) -> None:
    handles = bench.producer.submit_many(story_jobs(jobs, 24))
    wait_running(bench, handles)
    bench.redis.stop()  # SIGTERM: Redis writes its AOF
    time.sleep(down_s)
    bench.redis.start()
    back = time.monotonic()
    _, finished = watch(bench.connection, handles, back, None, timeout=600)
    result.finished_s += list(finished.values())
    delivered = deliveries(handles)
    result.deliveries += delivered
    result.notes.append(f"down {down_s:.0f} s")


def run_fault(fault: str, rounds: int, jobs: int, outage_s: float) -> FaultResult:
    result = FaultResult(fault, rounds)
    store = "redis" if fault.endswith("-redis") else "disk"
    with tempfile.TemporaryDirectory(prefix=f"kvrq-chaos-{fault}-") as tmp:
        bench = Bench(Path(tmp), store)
        try:
            env = FAST_LIVENESS if fault == "kill9-peer-fast" else None
            peer = fault != "kill9-alone"
            alive = [bench.start_worker(env)] + ([bench.start_worker(env)] if peer else [])
            for round_ in range(rounds):
                print(f"{fault}: round {round_ + 1}/{rounds}", flush=True)
                if fault.startswith("kill9-puts"):
                    alive = puts_round(bench, result, alive, round_)
                elif fault.startswith("kill9"):
                    alive = kill_round(bench, result, alive, jobs, env, peer=peer)
                elif fault == "redis-restart":
                    redis_round(bench, result, jobs, down_s=1.0)
                else:
                    redis_round(bench, result, jobs, down_s=outage_s)
                if any(w.exited() for w in alive):
                    result.notes.append("a worker exited on its own")
        finally:
            bench.close()
    return result


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        "\n| fault | rounds | jobs | finished | failed | lost | duplicated | crash re-runs | streamed twice "
        "| re-queued p50 / p95 s | finished p50 / p95 s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['fault']} | {r['rounds']} | {r['jobs']} | {r['finished']} | {r['failed']} | {r['lost']} "
            f"| {r['duplicated']} | {r['crash_rerun']} | {r['streamed_twice']} "
            f"| {fmt(r['requeued_p50_s'])} / {fmt(r['requeued_p95_s'])} "
            f"| {fmt(r['finished_p50_s'])} / {fmt(r['finished_p95_s'])} |"
        )
    for r in rows:
        for note in sorted(set(r["notes"])):
            print(f"- {r['fault']}: {note}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=20, help="rounds per fault [20]")
    parser.add_argument("--jobs", type=int, default=16, help="jobs in flight per round [16]")
    parser.add_argument(
        "--outage", type=float, default=30.0, help="seconds Redis is gone in redis-outage [30]"
    )
    parser.add_argument("--only", action="append", choices=FAULTS, help="run only these faults (repeat)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "chaos.json"))
    args = parser.parse_args(argv)
    started = time.monotonic()
    load_before = os.getloadavg()
    out = Path(args.out)
    earlier = json.loads(out.read_text()) if out.exists() and args.only else {}
    kept = [r for r in earlier.get("faults", []) if r["fault"] not in args.only] if args.only else []
    rows: list[dict[str, Any]] = []
    for fault in args.only or FAULTS:
        try:
            rows.append(run_fault(fault, args.rounds, args.jobs, args.outage).row())
        except Exception as exc:  # one broken fault run must not cost the others' figures
            print(f"{fault}: the run broke: {exc!r}", flush=True)
            rows.append({"fault": fault, "error": f"{type(exc).__name__}: {str(exc)[:2000]}"})
        report = {
            "command": " ".join(
                ["python", "benchmarks/chaos.py", *(argv if argv is not None else sys.argv[1:])]
            ),
            "machine": machine(),
            "load_average_before_after": [load_before, os.getloadavg()],
            "wall_s": round(time.monotonic() - started, 1),
            "faults": sorted([*kept, *rows], key=lambda r: FAULTS.index(r["fault"])),
            "earlier_runs": [
                *earlier.get("earlier_runs", []),
                *(
                    [{k: earlier[k] for k in ("command", "load_average_before_after", "wall_s")}]
                    if earlier
                    else []
                ),
            ],
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
    merged = sorted([*kept, *rows], key=lambda r: FAULTS.index(r["fault"]))
    print_table([r for r in merged if "error" not in r])
    for r in merged:
        if "error" in r:
            print(f"- {r['fault']}: run broke: {r['error'][:300]}")
    print(f"\nwall {round(time.monotonic() - started, 1)} s; wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
