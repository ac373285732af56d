"""Forks vs copies of an agent's cache in the store (issue 27: fork_from).

A fork (`fork_from`) starts a new agent from another's cache; the fork's first put stores the
parent's tokens again, and the store links the parent's full blocks from its shared area instead of
writing them. A copy writes every block anew (the same KV under token ids no agent stored, so
nothing can be linked: what a store without sharing does). Both run on the same store, alternately.

Run: python benchmarks/bench_fork.py [--tokens 8192] [--forks 8] [--new 64] [--redis-url URL] [--repeat 5]
Writes benchmarks/results/fork.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_store import fresh_tokens, random_cache, smollm2_spec  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "fork.json"


def extended(cache: Any, new_tokens: int, seed: int) -> Any:
    """`cache` plus `new_tokens` tokens of its own (a fork's next turn): the parent's full blocks as
    they are (the KV of the same tokens), new KV from the parent's last partial block on."""
    from engine.core.blocks import AgentCache

    extra = random_cache(cache.spec, cache.n_tokens + new_tokens, seed=seed)
    tokens = cache.token_ids + extra.token_ids[cache.n_tokens :]
    full = cache.n_tokens // cache.spec.block_tokens
    return AgentCache(cache.spec, tokens, [*cache.blocks[:full], *extra.blocks[full:]])


def stored_bytes(store: Any, kind: str, root: Path, prefix: str) -> int:
    """What the store holds now: files under its directory, or the values under its Redis prefix."""
    if kind == "disk":  # a shared block is one file with a hard link per agent: count each inode once
        files = {(s.st_dev, s.st_ino): s.st_size for p in root.rglob("*") if p.is_file() for s in [p.stat()]}
        return sum(files.values())
    client = store._client
    return sum(int(client.memory_usage(key) or 0) for key in client.scan_iter(f"{prefix}*"))


def bench(kind: str, tokens: int, forks: int, new: int, repeat: int, url: str, root: Path) -> dict[str, Any]:
    from store.disk import DiskStore
    from store.redis_store import RedisStore

    spec = smollm2_spec()
    prefix = f"kvrq:bench:fork:{time.time_ns()}:"
    store: Any = DiskStore(root / kind, spec) if kind == "disk" else RedisStore(url, spec, prefix=prefix)
    try:
        parent = random_cache(spec, tokens, seed=1)
        store.put("parent", parent)
        one_agent = stored_bytes(store, kind, root / kind, prefix)
        fork_s, copy_s, fork_written, copy_written = [], [], [], []
        for i in range(repeat):
            before = store.stats()["bytes_written"]
            start = time.perf_counter()
            store.put(f"fork-{i}", parent)  # a fork: the parent's tokens, its blocks linked
            fork_s.append(time.perf_counter() - start)
            fork_written.append(store.stats()["bytes_written"] - before)
            copy = fresh_tokens(parent, seed=100 + i)
            before = store.stats()["bytes_written"]
            start = time.perf_counter()
            store.put(f"copy-{i}", copy)  # a copy: every block written again
            copy_s.append(time.perf_counter() - start)
            copy_written.append(store.stats()["bytes_written"] - before)
            store.delete(f"fork-{i}")
            store.delete(f"copy-{i}")
        own_bytes = 0
        for i in range(forks):
            child = extended(parent, new, seed=200 + i)
            before = store.stats()["bytes_written"]
            store.put(f"branch-{i}", child)
            own_bytes += store.stats()["bytes_written"] - before
        with_forks = stored_bytes(store, kind, root / kind, prefix)
        for name in ["parent", *(f"branch-{i}" for i in range(forks))]:
            store.delete(name)
        return {
            "backend": kind,
            "tokens": tokens,
            "agent_mb": round(parent.nbytes / 1e6, 1),
            "fork_s": round(statistics.median(fork_s), 4),
            "copy_s": round(statistics.median(copy_s), 4),
            "time_ratio": round(statistics.median(fork_s) / statistics.median(copy_s), 4),
            "fork_written_mb": round(statistics.median(fork_written) / 1e6, 2),
            "copy_written_mb": round(statistics.median(copy_written) / 1e6, 1),
            "bytes_ratio": round(statistics.median(fork_written) / statistics.median(copy_written), 4),
            "forks": forks,
            "new_tokens_each": new,
            "stored_one_agent_mb": round(one_agent / 1e6, 1),
            "stored_with_forks_mb": round(with_forks / 1e6, 1),
            "forks_own_written_mb": round(own_bytes / 1e6, 1),
            "storage_vs_one_agent_plus_own": round(with_forks / (one_agent + own_bytes), 3),
        }
    finally:
        store.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192 + 100)
    parser.add_argument("--forks", type=int, default=8)
    parser.add_argument("--new", type=int, default=64, help="tokens each fork adds")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--only", default="disk,redis")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvrq-bench-fork-") as tmp:
        for kind in args.only.split(","):
            rows.append(
                bench(kind, args.tokens, args.forks, args.new, args.repeat, args.redis_url, Path(tmp))
            )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=2) + "\n")
    columns = list(rows[0])
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in columns) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
