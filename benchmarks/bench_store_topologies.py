"""The cache store on one Redis, on 3 independent primaries (the sharded store), on a Sentinel-managed
primary + replica (with and without `?wait=1`, the replica's confirmation of each put) and on a
3-primary Redis Cluster: put/get throughput as ratios to one Redis, in one run; and what sharding costs
in bytes stored when agents share a system prompt.

Run: nice python benchmarks/bench_store_topologies.py [--agents 12] [--tokens 512] [--threads 3]
Starts its own redis-server processes on free loopback ports (1 + 3 + primary, replica and 3 sentinels
+ a 3-node Cluster).
Writes benchmarks/results/store_topologies.json and prints markdown tables.

Two levels:
- store: RedisStore (one Redis) vs ShardedStore (3 primaries), the worker's own put/get of
  SmolLM2-shaped caches (float32, 46 KB per token), `--threads` agents at a time.
- raw: the same bytes as the store writes them (4 MB values, one pipeline per agent, SET then GET),
  on one Redis, on 3 primaries routed by the store's hash, and on Redis Cluster with every key of an
  agent under one hash tag `{agent}` (redis-py's RedisCluster): RedisStore itself cannot run on
  Cluster (its transactions mix an agent's keys with store-wide ones), so this is the upper bound a
  Cluster port of it could reach.
"""

from __future__ import annotations

import argparse
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis  # noqa: E402
from redis.cluster import ClusterNode, RedisCluster  # noqa: E402

from benchmarks.caches import make_cache, tokens  # noqa: E402
from benchmarks.common import machine, write_json  # noqa: E402
from benchmarks.sentinel import SentinelTopology  # noqa: E402
from engine.core.spec import LayerSpec, ModelCacheSpec  # noqa: E402
from producer.wire.redis_url import connect  # noqa: E402
from store.backend import BlockBackend  # noqa: E402
from store.factory import open_backend  # noqa: E402
from store.redis_store import MAX_VALUE_BYTES  # noqa: E402
from store.sharded import agent_route_key, pick  # noqa: E402
from worker.cli.spawn import free_port  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "store_topologies.json"
SLOTS = 16384
# SmolLM2-135M's cache shape: 30 layers, 3 KV heads of 64, float32: 46,080 bytes per token.
SPEC = ModelCacheSpec(
    model_name="smollm2-shaped",
    n_layers=30,
    layers=tuple(LayerSpec("full") for _ in range(30)),
    n_kv_heads=3,
    k_head_dim=64,
    v_head_dim=64,
    dtype="float32",
)


def free_cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free and below 65536 too."""
    for _ in range(200):
        port = random.randrange(20000, 45000)
        try:
            for candidate in (port, port + 10000):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", candidate))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair for a cluster node")


class Servers:
    """redis-server processes on loopback, killed on exit."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[subprocess.Popen[bytes]] = []
        self.topologies: list[SentinelTopology] = []
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("no redis-server on PATH (apt-get install redis-server)")
        self.binary = binary

    def start(self, *extra: str, port: int | None = None) -> int:
        port = port or free_port()
        argv = [self.binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        argv += ["--dir", str(self.workdir), *extra]
        self.procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if redis.Redis(port=port).ping():
                    return port
            except redis.RedisError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start on {port}")

    def cluster(self, nodes: int = 3) -> list[int]:
        """`nodes` primaries in one Cluster, the slots split evenly (no replicas)."""
        ports = [
            self.start(
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                f"nodes-{n}.conf",
                port=free_cluster_port(),
            )
            for n in range(nodes)
        ]
        clients = [redis.Redis(port=port) for port in ports]
        for index, client in enumerate(clients):
            first, last = index * SLOTS // nodes, (index + 1) * SLOTS // nodes - 1
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
        for port in ports[1:]:
            clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", port)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if all(b"cluster_state:ok" in c.execute_command("CLUSTER", "INFO") for c in clients):
                return ports
            time.sleep(0.1)
        raise RuntimeError("the cluster never reached cluster_state:ok")

    def stop(self) -> None:
        for topology in self.topologies:
            topology.stop()
        for proc in self.procs:
            proc.kill()
            proc.wait(timeout=10)


def used_memory(ports: Sequence[int]) -> int:
    return sum(int(redis.Redis(port=p).info("memory")["used_memory"]) for p in ports)


def flush(ports: Sequence[int]) -> None:
    for port in ports:
        redis.Redis(port=port).flushall()


def run_threads(action: Callable[[int], int], count: int, threads: int) -> tuple[float, int]:
    """(seconds, bytes) of `action(i)` for i < count on `threads` threads; action returns its bytes."""
    began = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        moved = sum(pool.map(action, range(count)))
    return time.perf_counter() - began, moved


# --- store level ----------------------------------------------------------------------------------
def store_round(
    backend: BlockBackend, agents: list[str], caches: list[Any], threads: int
) -> dict[str, float]:
    def put(i: int) -> int:
        assert backend.put(agents[i], caches[i])
        return int(caches[i].nbytes)

    def get(i: int) -> int:
        got = backend.get(agents[i])
        assert got is not None and got.n_tokens == caches[i].n_tokens
        return int(got.nbytes)

    put_s, put_bytes = run_threads(put, len(agents), threads)
    get_s, get_bytes = run_threads(get, len(agents), threads)
    for agent in agents:
        backend.delete(agent)
    return {
        "put_MBps": put_bytes / put_s / 1e6,
        "put_ops": len(agents) / put_s,
        "get_MBps": get_bytes / get_s / 1e6,
        "get_ops": len(agents) / get_s,
    }


# --- raw level ------------------------------------------------------------------------------------
def values_of(cache: Any) -> list[bytes]:
    blob = b"".join(
        bytes(memoryview(a).cast("B")) for block in cache.blocks for a in (*block.keys, *block.values)
    )
    return [blob[i : i + MAX_VALUE_BYTES] for i in range(0, len(blob), MAX_VALUE_BYTES)]


def raw_round(
    client_for: Callable[[str], Any], agents: list[str], values: list[list[bytes]], threads: int
) -> dict[str, float]:
    """Each agent: one pipeline SETting its values and a small manifest under `{agent}`, then one
    pipeline GETting them back."""

    def keys(agent: str, count: int) -> list[str]:
        return [f"raw:{{{agent}}}:b:{n}" for n in range(count)] + [f"raw:{{{agent}}}:m"]

    def put(i: int) -> int:
        pipe = client_for(agents[i]).pipeline(transaction=False)
        for key, value in zip(keys(agents[i], len(values[i])), [*values[i], b"m" * 512], strict=True):
            pipe.set(key, value)
        pipe.execute()
        return sum(map(len, values[i]))

    def get(i: int) -> int:
        pipe = client_for(agents[i]).pipeline(transaction=False)
        for key in keys(agents[i], len(values[i])):
            pipe.get(key)
        got = pipe.execute()
        assert all(v is not None for v in got)
        return sum(len(v) for v in got[:-1])

    put_s, put_bytes = run_threads(put, len(agents), threads)
    get_s, get_bytes = run_threads(get, len(agents), threads)
    return {
        "put_MBps": put_bytes / put_s / 1e6,
        "put_ops": len(agents) / put_s,
        "get_MBps": get_bytes / get_s / 1e6,
        "get_ops": len(agents) / get_s,
    }


def median_of(rounds: list[dict[str, float]]) -> dict[str, float]:
    return {name: statistics.median(r[name] for r in rounds) for name in rounds[0]}


@contextmanager
def opened(uri: str, **options: Any) -> Iterator[BlockBackend]:
    backend = open_backend(uri, SPEC, connect=connect, prefix_max_bytes=0, **options)
    try:
        yield backend
    finally:
        backend.close()


def dedup_cost(
    one: int, shards: list[int], sharers: int, system_tokens: int, own_tokens: int
) -> dict[str, Any]:
    """Bytes stored for `sharers` agents whose prompts share a system prompt, on 1 and on 3 shards."""
    system = tokens(system_tokens, seed=1)
    caches = [make_cache(SPEC, system + tokens(own_tokens, seed=100 + i)) for i in range(sharers)]
    out: dict[str, Any] = {"agents": sharers, "system_tokens": system_tokens, "own_tokens": own_tokens}
    for label, uri, ports in (
        ("one", f"redis://127.0.0.1:{one}/0", [one]),
        ("sharded", "shards:" + "|".join(f"redis://127.0.0.1:{p}/0" for p in shards), shards),
    ):
        flush(ports)
        before = used_memory(ports)
        with opened(uri) as backend:
            for i, cache in enumerate(caches):
                backend.put(f"sharer-{i}", cache)
        out[f"{label}_bytes"] = used_memory(ports) - before
        flush(ports)
    out["logical_bytes"] = sum(c.nbytes for c in caches)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--agents", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per agent cache")
    parser.add_argument("--threads", type=int, default=3, help="agents written/read at a time")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="kvrq-topologies-"))
    servers = Servers(workdir)
    try:
        one = servers.start()
        shards = [servers.start() for _ in range(3)]
        cluster_ports = servers.cluster(3)
        cluster = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", p) for p in cluster_ports])
        shard_uri = "shards:" + "|".join(f"redis://127.0.0.1:{p}/0" for p in shards)
        shard_names = [f"127.0.0.1:{p}/0" for p in shards]
        shard_clients = [redis.Redis(port=p) for p in shards]
        single = redis.Redis(port=one)

        agents = [f"agent-{i}" for i in range(args.agents)]
        caches = [make_cache(SPEC, tokens(args.tokens, seed=i)) for i in range(args.agents)]
        values = [values_of(cache) for cache in caches]
        spread = [pick(shard_names, agent_route_key(a)) for a in agents]

        (workdir / "sentinel").mkdir()
        sentinel = SentinelTopology(workdir / "sentinel").start()
        servers.topologies.append(sentinel)
        results: dict[str, list[dict[str, float]]] = {
            k: []
            for k in (
                "store_one",
                "store_sharded",
                "store_sentinel-wait0",
                "store_sentinel-wait1",
                "raw_one",
                "raw_sharded",
                "raw_cluster",
            )
        }
        for _ in range(args.rounds):  # interleaved, so load from other processes hits every topology
            with opened(f"redis://127.0.0.1:{one}/0") as backend:
                results["store_one"].append(store_round(backend, agents, caches, args.threads))
            with opened(shard_uri) as backend:
                results["store_sharded"].append(store_round(backend, agents, caches, args.threads))
            # A primary + replica under Sentinel; wait=1 (the default) confirms each put on the replica.
            for wait in (0, 1):
                with opened(f"{sentinel.url}?wait={wait}") as backend:
                    rounds = results[f"store_sentinel-wait{wait}"]
                    rounds.append(store_round(backend, agents, caches, args.threads))
            results["raw_one"].append(raw_round(lambda a: single, agents, values, args.threads))
            results["raw_sharded"].append(
                raw_round(
                    lambda a: shard_clients[pick(shard_names, agent_route_key(a))],
                    agents,
                    values,
                    args.threads,
                )
            )
            results["raw_cluster"].append(raw_round(lambda a: cluster, agents, values, args.threads))
            flush([one, *shards, *cluster_ports, sentinel.primary_port()])
        medians = {name: median_of(rounds) for name, rounds in results.items()}
        cost = dedup_cost(one, shards, sharers=12, system_tokens=1024, own_tokens=128)
    finally:
        servers.stop()
        shutil.rmtree(workdir, ignore_errors=True)

    report = {
        "machine": machine(),
        "args": vars(args),
        "agents_per_shard": [spread.count(i) for i in range(3)],
        "medians": medians,
        "dedup": cost,
    }
    write_json(RESULTS, report)
    load = report["machine"]["load_average"]

    mb = args.tokens * SPEC.bytes_per_token() / 1e6
    print(
        f"\n{args.agents} agents x {args.tokens} tokens ({mb:.1f} MB each), {args.threads} at a time, "
        f"median of {args.rounds} rounds; load average {load[0]:.1f}/{load[1]:.1f}; "
        f"agents per shard {report['agents_per_shard']}\n"
    )
    print("| level | topology | put MB/s | put agents/s | get MB/s | get agents/s | put / one | get / one |")
    print("|---|---|---|---|---|---|---|---|")
    for level in ("store", "raw"):
        base = medians[f"{level}_one"]
        for topo in ("one", "sharded", "sentinel-wait0", "sentinel-wait1", "cluster"):
            m = medians.get(f"{level}_{topo}")
            if m is None:
                continue
            print(
                f"| {level} | {topo} | {m['put_MBps']:.0f} | {m['put_ops']:.1f} | {m['get_MBps']:.0f} | "
                f"{m['get_ops']:.1f} | {m['put_MBps'] / base['put_MBps']:.2f} | "
                f"{m['get_MBps'] / base['get_MBps']:.2f} |"
            )
    print(
        f"\nDedup cost: {cost['agents']} agents sharing a {cost['system_tokens']}-token system prompt "
        f"(+{cost['own_tokens']} own tokens each): {cost['logical_bytes'] / 1e6:.0f} MB of caches; "
        f"Redis memory used {cost['one_bytes'] / 1e6:.0f} MB on one Redis, "
        f"{cost['sharded_bytes'] / 1e6:.0f} MB "
        f"on 3 shards ({cost['sharded_bytes'] / cost['one_bytes']:.2f}x)"
    )


if __name__ == "__main__":
    main()
