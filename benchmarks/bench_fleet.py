"""Fleet benchmark: two `kvrq worker` processes, one Redis, `--store redis`, affinity on vs off.

    python benchmarks/bench_fleet.py                 # 6 agents x 4 turns, each mode
    python benchmarks/bench_fleet.py --agents 4 --turns 3 --max-tokens 12

Each agent has its own ~400-token briefing (so every later turn has something to resume) and
takes its turns one after another; agents run concurrently. Per mode, with fresh workers and an
empty Redis: hot-tier hit rate (turns served from the worker's memory), prompt tokens reused,
and the client-side time to first token of later turns (median, p95). With affinity off, a
later turn lands on either worker and reads the other's cache from Redis; with affinity on it
goes to the worker that holds it hot. Everything runs on this machine, on loopback.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import machine, write_json  # noqa: E402
from engine.cpu.blas import ensure_fast_blas  # noqa: E402

TOPICS = ["a lighthouse", "a bakery", "a mountain hut", "a river ferry", "a small library", "an orchard"]
QUESTIONS = [
    "Who works there?",
    "What happens in winter?",
    "Name one problem they have.",
    "How is it solved?",
]


def briefing(topic: str) -> str:
    facts = [
        f"This briefing is about {topic} on a quiet northern coast, run by three people.",
        "They keep a logbook of every visitor, every delivery and every repair.",
        "They read the logbook aloud each Sunday evening.",
        "In spring the roads flood twice, in summer the tourists come, in autumn the storms begin.",
        "The oldest of them has worked there for thirty-one years and knows every stone of the place.",
        "The youngest arrived last year from the city and still writes letters home every week.",
    ]
    return " ".join(facts * 3)


def agent_turns(
    producer: Any, agent: str, topic: str, turns: int, max_tokens: int, out: list[dict[str, Any]]
) -> None:
    chat = [{"role": "system", "content": briefing(topic)}]
    for turn in range(turns):
        chat.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
        started = time.perf_counter()
        handle = producer.submit({"agent_id": agent, "messages": list(chat), "max_tokens": max_tokens})
        first = None
        for event in handle.events(timeout=600):
            if event.kind == "delta" and first is None:
                first = time.perf_counter() - started
        result = handle.result(timeout=600)
        chat.append({"role": "assistant", "content": result.text})
        out.append(
            {
                "agent": agent,
                "turn": turn,
                "worker": result.worker,
                "ttft_s": first,
                "prompt_tokens": result.usage.prompt_tokens,
                "reused_tokens": result.usage.reused_tokens,
            }
        )


def run_mode(affinity: bool, args: argparse.Namespace) -> dict[str, Any]:
    from redis import Redis

    from producer.client import Producer
    from producer.wire.protocol import CACHE_LOOKUPS_FIELD, HOT_HITS_FIELD
    from worker.cli.spawn import redis_server, worker_process

    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvrq-fleet-")))
        url = stack.enter_context(redis_server(workdir))
        env = {**os.environ, "KVRQ_AFFINITY": "true" if affinity else "false", "KVRQ_MAX_BATCH": "8"}
        env["KVRQ_HEARTBEAT_INTERVAL"] = "1"  # the worker hash's cache figures are published per heartbeat
        names = [f"fleet-{i}" for i in range(2)]
        for name in names:
            stack.enter_context(worker_process(url, store="redis", name=name, env=env))
        producer = stack.enter_context(Producer(url, affinity=affinity))
        rows: list[dict[str, Any]] = []
        threads = [
            threading.Thread(
                target=agent_turns,
                args=(producer, f"agent-{i}", TOPICS[i % len(TOPICS)], args.turns, args.max_tokens, rows),
            )
            for i in range(args.agents)
        ]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - started
        time.sleep(2.5)  # two heartbeats: the last lookups are in the workers' hashes
        connection = Redis.from_url(url)
        lookups = hot_hits = 0
        for name in names:
            fields = {k.decode(): v.decode() for k, v in connection.hgetall(f"rq:worker:{name}").items()}
            lookups += int(fields.get(CACHE_LOOKUPS_FIELD, 0))
            hot_hits += int(fields.get(HOT_HITS_FIELD, 0))
    later = [r for r in rows if r["turn"] > 0]
    ttfts = sorted(r["ttft_s"] for r in later if r["ttft_s"] is not None)
    moved = sum(
        1
        for r in later
        if r["worker"]
        != next(x["worker"] for x in rows if x["agent"] == r["agent"] and x["turn"] == r["turn"] - 1)
    )
    return {
        "affinity": affinity,
        "wall_s": wall,
        "later_turns": len(later),
        "later_turns_on_another_worker": moved,
        "hot_tier_hit_rate": hot_hits / lookups if lookups else None,
        "reused_share_later_turns": sum(r["reused_tokens"] for r in later)
        / max(1, sum(r["prompt_tokens"] for r in later)),
        "ttft_later_median_s": statistics.median(ttfts) if ttfts else None,
        "ttft_later_p95_s": ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))] if ttfts else None,
        "turns": rows,
    }


def main() -> int:
    ensure_fast_blas(sys.argv)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--agents", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fleet.json"))
    args = parser.parse_args()
    report = {"machine": machine(), "modes": []}
    for affinity in (False, True):
        print(f"affinity {'on' if affinity else 'off'} ...", flush=True)
        report["modes"].append(run_mode(affinity, args))
    report["load_average_at_end"] = os.getloadavg()
    write_json(args.out, report)
    print("| affinity | later turns | moved | hot-tier hits | prompt reused | TTFT p50 | TTFT p95 | wall |")
    print("|---|---|---|---|---|---|---|---|")
    for m in report["modes"]:
        rate = "-" if m["hot_tier_hit_rate"] is None else f"{m['hot_tier_hit_rate']:.0%}"
        cells = [
            "on" if m["affinity"] else "off",
            str(m["later_turns"]),
            str(m["later_turns_on_another_worker"]),
            rate,
            f"{m['reused_share_later_turns']:.0%}",
            f"{m['ttft_later_median_s']:.2f} s",
            f"{m['ttft_later_p95_s']:.2f} s",
            f"{m['wall_s']:.0f} s",
        ]
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
