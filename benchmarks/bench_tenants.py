"""What walling tenants off costs: one agents workload run as one tenant, as four, and without tenants.

    python benchmarks/bench_tenants.py              # 4 agents x 3 turns, 2 rounds; results/tenants.json
    python benchmarks/bench_tenants.py --agents 4 --turns 2 --rounds 1 --out /tmp/tenants.json

A private redis-server and one real `kvrq worker` on the builtin model. Every side runs the same jobs:
`--agents` agents, each `--turns` chat turns (`continue`), all agents' turn k submitted together, every
agent's first turn opening with the same ~300-token system prompt (the prefix agents of one tenant
share). Sides: no tenant (today's single app), one tenant holding all agents, four tenants holding a
quarter each (Producer(tenant=...), the rule kvrq serve applies per API key). Reported per side: the
wall time, and per tenant the prompt tokens and the share reused from caches. Walls cost only what
they must: each of four tenants prefills the shared system prompt once where one tenant does it once
in all. Tenant names and the system prompt are new each round and side (nothing carries over), and
the sides' order alternates between rounds; the ratio is four tenants' wall over one tenant's, per round.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import machine, write_json  # noqa: E402
from benchmarks.procs import RedisProcess, WorkerProcess  # noqa: E402
from producer.client import Producer  # noqa: E402

SIDES = ("no tenant", "one tenant", "four tenants")


def system_prompt(nonce: str) -> str:
    lines = " ".join(f"Rule {i}: answer briefly and cite the ledger entry {i}." for i in range(30))
    return f"Session {nonce}. You are the ledger assistant. {lines}"


def run_side(redis_url: str, side: str, agents: int, turns: int, nonce: str) -> dict[str, Any]:
    """Run the workload as `side`; wall seconds and {tenant: [prompt tokens, reused tokens]}."""
    named = {"one tenant": [f"solo-{nonce}"], "four tenants": [f"t{i}-{nonce}" for i in range(4)]}
    tenants: list[str | None] = [None] if side == "no tenant" else list(named[side])
    producers = {tenant: Producer(redis_url, tenant=tenant) for tenant in tenants}
    owner = {agent: tenants[agent * len(tenants) // agents] for agent in range(agents)}
    system = {"role": "system", "content": system_prompt(nonce)}
    figures: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    started = time.perf_counter()
    for turn in range(turns):
        handles = []
        for agent in range(agents):
            ask = {"role": "user", "content": f"Agent {agent}, turn {turn}: what is entry {agent + turn}?"}
            request = {
                "agent_id": f"agent-{agent}-{nonce}",  # new agents every run, whatever the side
                "continue": True,
                "messages": [system, ask] if turn == 0 else [ask],
                "max_tokens": 8,
                "temperature": 0.0,
            }
            handles.append((owner[agent], producers[owner[agent]].submit(request)))
        for tenant, handle in handles:
            usage = handle.result(timeout=600).usage
            figures[tenant or "-"][0] += usage.prompt_tokens
            figures[tenant or "-"][1] += usage.reused_tokens
    wall = time.perf_counter() - started
    for producer in producers.values():
        producer.close()
    return {"wall_s": round(wall, 2), "tenants": {name: figures[name] for name in sorted(figures)}}


def reuse_text(tenants: dict[str, list[int]]) -> str:
    return ", ".join(f"{100 * reused / prompt:.0f}%" for prompt, reused in tenants.values())


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--agents", type=int, default=4, help="agents per side (a multiple of 4) [4]")
    parser.add_argument("--turns", type=int, default=3, help="turns per agent [3]")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "tenants.json"))
    args = parser.parse_args()
    if args.agents % 4:
        parser.error("--agents must be a multiple of 4 (four tenants hold a quarter each)")
    report: dict[str, Any] = {
        "command": " ".join(["python", "benchmarks/bench_tenants.py", *sys.argv[1:]]),
        "machine": machine(),
        "load_average_before": os.getloadavg(),
        "rows": [],
    }
    with tempfile.TemporaryDirectory(prefix="kvrq-bench-tenants-") as tmp:
        redis = RedisProcess(Path(tmp))
        redis.start()
        worker = WorkerProcess(redis.url, Path(tmp), name="bench-tenants")
        try:
            worker.start()
            run_side(redis.url, "no tenant", 4, 1, "warm")  # the engine's first steps, not measured
            for round_ in range(1, args.rounds + 1):
                order = SIDES if round_ % 2 else SIDES[::-1]
                for side in order:
                    ran = run_side(redis.url, side, args.agents, args.turns, secrets.token_hex(4))
                    report["rows"].append({"round": round_, "side": side, **ran})
                    print(f"round {round_}: {side}: {ran['wall_s']} s, reuse {reuse_text(ran['tenants'])}")
        finally:
            worker.stop()
            redis.stop()
    report["load_average_after"] = os.getloadavg()
    walls = {(row["round"], row["side"]): row["wall_s"] for row in report["rows"]}
    report["wall_ratio_four_over_one"] = [
        round(walls[(r, "four tenants")] / walls[(r, "one tenant")], 3) for r in range(1, args.rounds + 1)
    ]
    print("\n| round | side | wall s | prompt tokens | reused per tenant |")
    print("|---|---|---|---|---|")
    for row in report["rows"]:
        prompt, reuse = sum(p for p, _ in row["tenants"].values()), reuse_text(row["tenants"])
        print(f"| {row['round']} | {row['side']} | {row['wall_s']:.2f} | {prompt} | {reuse} |")
    print(f"\nwall, four tenants / one tenant: {report['wall_ratio_four_over_one']}")
    out = write_json(args.out, report)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
