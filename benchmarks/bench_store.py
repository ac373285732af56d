"""Store benchmarks: disk and Redis throughput vs plain I/O of the same bytes, forks vs copies of an
agent, warm resume vs cold prefill on the builtin model, and what KV quantization at rest costs in size
and in output.

Run: LD_PRELOAD=/lib/x86_64-linux-gnu/libopenblas.so.0 python benchmarks/bench_store.py
     [--quick] [--only disk,redis,shared,fork,resume,quant] [--redis-url URL] [--dir PATH] [--forks N]
(the script also re-execs itself with OpenBLAS preloaded when it is installed and not loaded).
Writes benchmarks/results/store.json and prints markdown tables.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import table  # noqa: E402
from engine.core.params import SamplingParams
from engine.cpu.blas import ensure_fast_blas  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "store.json"
FLOOR_SPEEDUP = {512: 27, 1024: 59, 2048: 124}  # raw mlx-lm warm resume, docs/platform.md
GB = 1e9


def timed(fn: Callable[[], object], repeat: int, setup: Callable[[], object] | None = None) -> list[float]:
    out = []
    for _ in range(repeat):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def paired(
    store_fn: Callable[[], object],
    plain_fn: Callable[[], object],
    repeat: int,
    setup: Callable[[], object] | None = None,
) -> tuple[list[float], list[float]]:
    """Time the store and its plain baseline alternately, so load from other processes hits both."""
    store_s: list[float] = []
    plain_s: list[float] = []
    timed(store_fn, 1, setup)  # warm-up, untimed: first-touch page faults, connections, files
    timed(plain_fn, 1, setup)
    for _ in range(repeat):
        store_s += timed(store_fn, 1, setup)
        plain_s += timed(plain_fn, 1, setup)
    return store_s, plain_s


def smollm2_spec() -> Any:
    """SmolLM2-135M's cache layout as the engine reads it from the model (float32 on the CPU)."""
    from engine.core.spec import LayerSpec, ModelCacheSpec

    return ModelCacheSpec("smollm2-135m", 30, (LayerSpec("full"),) * 30, 3, 64, 64, "float32")


def random_cache(spec: Any, n_tokens: int, seed: int = 0) -> Any:
    import numpy as np

    from engine.core.blocks import AgentCache, KVBlock

    rng = np.random.default_rng(seed)
    blocks = []
    for start in range(0, n_tokens, spec.block_tokens):
        n = min(spec.block_tokens, n_tokens - start)
        shape = (spec.n_kv_heads, n, spec.k_head_dim)
        blocks.append(
            KVBlock(
                keys=tuple(rng.standard_normal(shape, dtype=np.float32) for _ in range(spec.n_layers)),
                values=tuple(rng.standard_normal(shape, dtype=np.float32) for _ in range(spec.n_layers)),
            )
        )
    token_ids = [int(t) for t in rng.integers(0, 49152, size=n_tokens)]
    return AgentCache(spec, token_ids, blocks)


def fresh_tokens(cache: Any, seed: int) -> Any:
    """The same KV under other token ids: blocks no agent stored before, so a put writes them all
    (with the same tokens, the store would link the blocks an earlier put stored: shared prefixes)."""
    import numpy as np

    from engine.core.blocks import AgentCache

    token_ids = [int(t) for t in np.random.default_rng(10_000 + seed).integers(0, 49152, size=cache.n_tokens)]
    return AgentCache(cache.spec, token_ids, cache.blocks)


def block_blobs(cache: Any) -> list[bytes]:
    """The same bytes the store writes for each block, as ready-made values for the baselines."""
    from store.block_codec import encode_block

    blobs = []
    for block in cache.blocks:
        encoded = encode_block(block, cache.spec, "none", 0)
        blobs.append(b"".join(bytes(p) for p in encoded.parts()))
    return blobs


def row(kind: str, n_tokens: int, nbytes: int, op: str, store_s: list[float], plain_s: list[float]) -> dict:
    best_store, best_plain = min(store_s), min(plain_s)
    return {
        "backend": kind,
        "tokens": n_tokens,
        "mb": round(nbytes / 1e6, 1),
        "op": op,
        "store_gbps": round(nbytes / best_store / GB, 3),
        "plain_gbps": round(nbytes / best_plain / GB, 3),
        "store_gbps_median": round(nbytes / statistics.median(store_s) / GB, 3),
        "plain_gbps_median": round(nbytes / statistics.median(plain_s) / GB, 3),
        "ratio": round(best_plain / best_store, 3),
    }


# --- disk ----------------------------------------------------------------------------------------
def bench_disk(sizes: list[int], repeat: int, root: Path) -> list[dict]:
    from store.disk import DiskStore

    spec = smollm2_spec()
    rows = []
    for n_tokens in sizes:
        cache = random_cache(spec, n_tokens)
        blob = b"".join(block_blobs(cache))
        for fsync in (True, False):
            directory = root / f"disk-{n_tokens}-{fsync}"
            store = DiskStore(directory / "store", spec, fsync=fsync)
            plain = directory / "plain.bin"
            counter = iter(range(10**6))

            def put(s: DiskStore = store, c: Any = cache, n: Any = counter) -> None:
                i = next(n)  # a new agent with new tokens each time: every block is written
                s.put(f"agent-{i}", fresh_tokens(c, i))

            def write(p: Path = plain, b: bytes = blob, sync: bool = fsync) -> None:
                with open(p, "wb") as f:
                    f.write(b)
                    if sync:
                        f.flush()
                        os.fsync(f.fileno())

            def clear(s: DiskStore = store) -> None:
                for agent in s.list():
                    s.delete(agent)

            put_s, write_s = paired(put, write, repeat, setup=clear)
            suffix = "" if fsync else " (no fsync)"
            rows.append(row("disk", n_tokens, len(blob), "put" + suffix, put_s, write_s))
            if fsync:
                store.put("reader", cache)
                got = store.get("reader")
                assert got is not None and got.token_ids == cache.token_ids

                def read(p: Path = plain) -> bytes:
                    with open(p, "rb") as f:
                        return f.read()

                get_s, read_s = paired(functools.partial(store.get, "reader"), read, repeat)
                rows.append(row("disk", n_tokens, len(blob), "get", get_s, read_s))
            shutil.rmtree(directory)
    return rows


# --- redis ---------------------------------------------------------------------------------------
def redis_values(blobs: list[bytes], value_bytes: int) -> list[bytes]:
    """The block blobs cut into the values RedisStore stores (byte ranges of at most value_bytes)."""
    return [blob[i : i + value_bytes] for blob in blobs for i in range(0, len(blob), value_bytes)]


def bench_redis(sizes: list[int], repeat: int, url: str) -> list[dict]:
    import redis

    from store.redis_store import MAX_VALUE_BYTES, RedisStore

    spec = smollm2_spec()
    prefix = "kvrq:bench:"
    client = redis.Redis.from_url(url)
    rows = []
    for n_tokens in sizes:
        cache = random_cache(spec, n_tokens)
        values = redis_values(block_blobs(cache), MAX_VALUE_BYTES)  # raw values of the same sizes
        nbytes = sum(len(v) for v in values)
        store = RedisStore(url, spec, prefix=prefix)
        keys = [f"{prefix}raw:{i}" for i in range(len(values))]

        def clear(s: RedisStore = store, ks: list[str] = keys) -> None:
            for agent in s.list():
                s.delete(agent)
            client.delete(*ks)

        def raw_set(ks: list[str] = keys, vs: list[bytes] = values) -> None:
            pipe = client.pipeline(transaction=False)
            for k, v in zip(ks, vs, strict=True):
                pipe.set(k, v)
            pipe.execute()

        def raw_get(ks: list[str] = keys) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for k in ks:
                pipe.get(k)
            return pipe.execute()

        counter = iter(range(10**6))

        def put(s: RedisStore = store, c: Any = cache, n: Any = counter) -> None:
            i = next(n)
            s.put(f"agent-{i}", fresh_tokens(c, i))

        put_s, set_s = paired(put, raw_set, repeat, setup=clear)
        rows.append(row("redis", n_tokens, nbytes, "put", put_s, set_s) | {"values": len(values)})
        store.put("reader", cache)
        raw_set()
        get_s, rawget_s = paired(functools.partial(store.get, "reader"), raw_get, repeat)
        rows.append(row("redis", n_tokens, nbytes, "get", get_s, rawget_s) | {"values": len(values)})
        clear()
        store.close()
    return rows


# --- shared prefixes ---------------------------------------------------------------------------
def bench_shared(prefix_tokens: int, agents: int, url: str, root: Path) -> list[dict]:
    """`agents` agents whose caches share a `prefix_tokens`-token prefix (each + 300 own tokens):
    what the store holds and writes, and a newcomer's warm start (get with a prompt, no cache of its
    own) against an agent's get of its own cache of the same length."""
    import numpy as np

    from engine.core.blocks import AgentCache
    from store.disk import DiskStore
    from store.redis_store import RedisStore

    spec = smollm2_spec()
    base = random_cache(spec, prefix_tokens + 300)
    prefix_ids = base.token_ids[:prefix_tokens]
    n_prefix_blocks = prefix_tokens // spec.block_tokens
    rows = []
    for kind in ("disk", "redis"):
        store: Any = (
            DiskStore(root / "shared-bench", spec)
            if kind == "disk"
            else RedisStore(url, spec, prefix="kvrq:bench:shared:")
        )
        put_s = []
        for i in range(agents):
            own = [int(t) for t in np.random.default_rng(i).integers(0, 49152, size=300)]
            cache = AgentCache(spec, prefix_ids + own, base.blocks)  # same KV: the prefix blocks are equal
            start = time.perf_counter()
            store.put(f"agent-{i}", cache)
            put_s.append(time.perf_counter() - start)
        stats = store.stats()
        total = sum(store.info(f"agent-{i}").nbytes for i in range(agents))  # what each agent references
        prompt = prefix_ids + [7] * 50
        warm_s, own_s = paired(
            functools.partial(store.get, "newcomer", prompt_tokens=prompt),
            functools.partial(store.get, "agent-0", prompt_tokens=prefix_ids + [7]),
            5,
        )
        got = store.get("newcomer", prompt_tokens=prompt)
        assert got is not None and got.n_tokens == n_prefix_blocks * spec.block_tokens
        rows.append(
            {
                "backend": kind,
                "agents": agents,
                "prefix_tokens": prefix_tokens,
                "referenced_mb": round(total / 1e6, 1),
                "written_mb": round(stats["bytes_written"] / 1e6, 1),
                "saved_mb": round(stats["bytes_saved"] / 1e6, 1),
                "first_put_s": round(put_s[0], 3),
                "later_put_s": round(statistics.median(put_s[1:]), 3),
                "warm_start_get_s": round(min(warm_s), 3),
                "own_get_s": round(min(own_s), 3),
                "warm_vs_own": round(min(own_s) / min(warm_s), 3),
                "cross_agent_hits": store.stats()["cross_agent_hits"],
            }
        )
        for i in range(agents):
            store.delete(f"agent-{i}")
        store.close()
    return rows


# --- the builtin model: warm resume and quantization -----------------------------------------------
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


def bench_fork(
    kind: str, tokens: int, forks: int, new: int, repeat: int, url: str, root: Path
) -> dict[str, Any]:
    """A fork's put (the parent's blocks linked, issue 27: fork_from) vs a copy's (every block written),
    alternately on one store; then `forks` forks of `new` tokens each: the bytes they add."""
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


def load_engine() -> Any:
    from engine.batch.engine import BlockPoolBatchEngine
    from engine.models.load import load_model

    model, tokenizer = load_model("smollm2-135m")
    return BlockPoolBatchEngine(model, tokenizer, model_name="smollm2-135m", pool_mb=4096, max_batch=4)


def run_to_end(
    engine: Any, agent: str | None, prompt: list[int], cache: Any, max_tokens: int
) -> tuple[Any, float]:
    """(completion, seconds from submit to the first generated token)."""
    start = time.perf_counter()
    uid = engine.submit(agent, prompt, SamplingParams(max_tokens=max_tokens), cache=cache)
    first = None
    while True:
        out = engine.step()
        if first is None and any(d.uid == uid for d in out.deltas):
            first = time.perf_counter() - start
        for completion in out.completions:
            if completion.uid == uid:
                assert first is not None
                return completion, first


def context_prompt(tokenizer: Any, n_tokens: int) -> list[int]:
    text = (
        "The history of the printing press begins with movable type in East Asia and continues in "
        "Europe with Gutenberg, whose presses spread across cities within decades. "
    )
    ids = tokenizer.encode(text * (n_tokens // 20 + 8))
    return list(ids[:n_tokens])


def first_token_direct(model: Any, layers: list[Any], tokens: list[int], step: int = 512) -> int:
    """Run `tokens` through the model on top of `layers` (mlx-lm KVCaches) and pick the next token,
    the way mlx-lm's generate does: all but the last token in `step`-token chunks that only fill
    the cache (no logits), then the last token alone."""
    import mlx.core as mx

    for start in range(0, len(tokens) - 1, step):
        model(mx.array(tokens[start : min(start + step, len(tokens) - 1)])[None], cache=layers)
        mx.eval([c.state for c in layers])
    logits = model(mx.array(tokens[-1:])[None], cache=layers)
    token = mx.argmax(logits[0, -1])
    mx.eval(token)
    return int(token.item())  # type: ignore[arg-type]


def bench_resume_direct(engine: Any, contexts: list[int], repeat: int, root: Path) -> list[dict]:
    """The floor's own method (docs/platform.md: load_prompt_cache + one step), with the store:
    cold = prefill of the whole context as mlx-lm's generate does it (512-token steps) to the first token;
    warm = store get (disk: read, CRC, decode) + rebuild mlx-lm KVCaches + one forward step."""
    from mlx_lm.models.cache import make_prompt_cache

    from engine.kv.convert import blocks_to_caches
    from store.disk import DiskStore

    model = engine.model
    store = DiskStore(root / "resume-direct", engine.spec)
    rows = []
    for n_ctx in contexts:
        prompt = context_prompt(engine.tokenizer, n_ctx)
        turn1, _ = run_to_end(engine, "direct", prompt, None, 2)
        store.put("direct", turn1.cache)
        resumed = prompt + turn1.token_ids[:1]
        cold_s, warm_s, get_s, firsts = [], [], [], set()
        for _ in range(repeat):
            start = time.perf_counter()
            firsts.add(first_token_direct(model, make_prompt_cache(model), resumed))
            cold_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            cache = store.get("direct")
            got = time.perf_counter() - start
            assert cache is not None
            layers = blocks_to_caches(cache, len(resumed) - 1)
            firsts.add(first_token_direct(model, layers, resumed[-1:]))
            warm_s.append(time.perf_counter() - start)
            get_s.append(got)
        cold, warm = min(cold_s), min(warm_s)
        floor = FLOOR_SPEEDUP.get(n_ctx)
        rows.append(
            {
                "context": n_ctx,
                "cold_ttft_s": round(cold, 3),
                "warm_ttft_s": round(warm, 4),
                "store_get_s": round(min(get_s), 4),
                "speedup": round(cold / warm, 1),
                "floor_speedup": floor,
                "vs_floor": round(cold / warm / floor, 2) if floor else None,
                "first_token_identical": len(firsts) == 1,
            }
        )
    store.close()
    return rows


def bench_resume(engine: Any, contexts: list[int], repeat: int, root: Path) -> list[dict]:
    """Time to first token of turn 2 (the context + 1 new token): cold prefill of everything vs
    store get + engine rebuild + one step, from disk (another worker's cache: read, CRC-checked,
    decoded) and from the hot tier (the same worker: no I/O)."""
    from store.disk import DiskStore
    from store.hot import HotTierStore

    disk = DiskStore(root / "resume", engine.spec)
    hot = HotTierStore(DiskStore(root / "resume-hot", engine.spec), 1 << 30)
    rows = []
    for n_ctx in contexts:
        prompt = context_prompt(engine.tokenizer, n_ctx)
        turn1, _ = run_to_end(engine, "bench", prompt, None, 2)
        disk.put("bench", turn1.cache)
        hot.put("bench", turn1.cache)
        # Turn 2 continues the conversation by one token: a warm start prefills just that token.
        # max_tokens=2 keeps the cut of the finished cache into blocks out of the first token's step.
        resumed = prompt + turn1.token_ids[:1]
        firsts: set[int] = set()
        times: dict[str, list[float]] = {"cold": [], "disk": [], "hot": [], "get_disk": [], "get_hot": []}
        for _ in range(repeat):
            done, ttft = run_to_end(engine, None, resumed, None, 2)
            times["cold"].append(ttft)
            firsts.add(done.token_ids[0])
            for name, store in (("disk", disk), ("hot", hot)):
                start = time.perf_counter()
                cache = store.get("bench")
                got = time.perf_counter() - start
                done, ttft = run_to_end(engine, None, resumed, cache, 2)
                assert done.usage.reused_tokens == len(resumed) - 1, done.usage
                times[name].append(got + ttft)
                times[f"get_{name}"].append(got)
                firsts.add(done.token_ids[0])
        cold, warm, warm_hot = min(times["cold"]), min(times["disk"]), min(times["hot"])
        floor = FLOOR_SPEEDUP.get(n_ctx)
        rows.append(
            {
                "context": n_ctx,
                "cache_mb": round(turn1.cache.nbytes / 1e6, 1),
                "cold_ttft_s": round(cold, 3),
                "warm_ttft_s": round(warm, 4),
                "store_get_s": round(min(times["get_disk"]), 4),
                "speedup": round(cold / warm, 1),
                "warm_hot_ttft_s": round(warm_hot, 4),
                "speedup_hot": round(cold / warm_hot, 1),
                "floor_speedup": floor,
                "vs_floor": round(cold / warm / floor, 2) if floor else None,
                "first_token_identical": len(firsts) == 1,
            }
        )
    disk.close()
    hot.close()
    return rows


QUANT_PROMPTS = [
    "Explain in a few sentences why the sky is blue.",
    "Write a short story about a robot who learns to paint.",
    "List five tips for staying productive while working from home, with one sentence each.",
]


def bench_quant(engine: Any, root: Path, new_tokens: int = 64) -> list[dict]:
    """Bytes per 1K tokens and greedy agreement with the unquantized resume over `new_tokens`."""
    from store.disk import DiskStore

    tok = engine.tokenizer
    conversations = []
    for index, question in enumerate(QUANT_PROMPTS):
        messages = [{"role": "user", "content": question}]
        prompt = list(tok.apply_chat_template(messages, add_generation_prompt=True))
        turn1, _ = run_to_end(engine, f"q{index}", prompt, None, 48)
        messages += [
            {"role": "assistant", "content": turn1.text},
            {"role": "user", "content": "Now say it again, more briefly."},
        ]
        follow_up = list(tok.apply_chat_template(messages, add_generation_prompt=True))
        conversations.append((turn1.cache, follow_up))
    outputs: dict[str, list[list[int]]] = {}
    rows = []
    for mode, group in (("none", 0), ("q8", 64), ("q8", 32), ("q4", 64), ("q4", 32)):
        label = f"{mode}/{group}" if group else mode
        store = DiskStore(
            root / f"quant-{label.replace('/', '-')}", engine.spec, quantization=mode, group_size=group or 64
        )
        outputs[label] = []
        stored = tokens = 0
        for index, (cache, follow_up) in enumerate(conversations):
            store.put(f"q{index}", cache)
            info = store.info(f"q{index}")
            assert info is not None
            stored += info.nbytes
            tokens += info.n_tokens
            resumed = store.get(f"q{index}")
            done, _ = run_to_end(engine, None, follow_up, resumed, new_tokens)
            outputs[label].append(list(done.token_ids))
        store.close()
        agreements = [_agreement(ref, got) for ref, got in zip(outputs["none"], outputs[label], strict=True)]
        rows.append(
            {
                "quantization": mode,
                "group_size": group or None,
                "bytes_per_1k_tokens": int(stored / tokens * 1000),
                "vs_none": None,
                "identical_prompts": sum(1 for a in agreements if a["identical"]),
                "prompts": len(agreements),
                "first_divergence": [a["first_divergence"] for a in agreements],
                "token_agreement": round(
                    sum(a["matching"] for a in agreements) / max(1, sum(a["length"] for a in agreements)), 3
                ),
            }
        )
    fresh = []
    for _index, (_cache, follow_up) in enumerate(conversations):
        done, _ = run_to_end(engine, None, follow_up, None, new_tokens)
        fresh.append(list(done.token_ids))
    none_bytes = rows[0]["bytes_per_1k_tokens"]
    for r in rows:
        r["vs_none"] = round(r["bytes_per_1k_tokens"] / none_bytes, 3)
    rows[0]["identical_to_fresh_prefill"] = fresh == outputs["none"]
    return rows


def _agreement(reference: list[int], got: list[int]) -> dict[str, Any]:
    length = max(len(reference), len(got))
    matching = sum(1 for a, b in zip(reference, got, strict=False) if a == b)
    divergence = next(
        (i for i, (a, b) in enumerate(zip(reference, got, strict=False)) if a != b),
        None if len(reference) == len(got) else min(len(reference), len(got)),
    )
    return {
        "identical": reference == got,
        "matching": matching,
        "length": length,
        "first_divergence": divergence,
    }


# --- report --------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer repeats, smaller sizes")
    parser.add_argument(
        "--only", default="disk,redis,shared,fork,resume,quant", help="comma-separated sections"
    )
    parser.add_argument("--forks", type=int, default=8, help="forks of one agent (section fork) [8]")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--dir", default=None, help="directory for the disk benchmark (default: a temp dir)")
    parser.add_argument("--output", default=str(RESULTS))
    args = parser.parse_args(argv)
    sections = set(args.only.split(","))
    repeat = 3 if args.quick else 7
    sizes = [1024, 4096] if args.quick else [1024, 4096, 8192]
    redis_sizes = [1024, 4096] if args.quick else [1024, 2048, 4096, 8192]
    root = Path(tempfile.mkdtemp(prefix="kvrq-bench-", dir=args.dir))
    results: dict[str, Any] = {
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
    }
    run_info = {
        "command": " ".join(["python", *sys.argv]),
        "openblas_preloaded": "openblas" in os.environ.get("LD_PRELOAD", ""),
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        # Other processes share this machine's 2 cores: the load average says how much.
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }
    try:
        if "disk" in sections:
            results["disk"] = bench_disk(sizes, repeat, root)
            print(f"\n## Disk (best of {repeat}; ratio = store / plain)\n")
            print(table(results["disk"], ["tokens", "mb", "op", "store_gbps", "plain_gbps", "ratio"]))
        if "redis" in sections:
            results["redis"] = bench_redis(redis_sizes, repeat, args.redis_url)
            print(f"\n## Redis (best of {repeat}; plain = raw pipelined SET/GET of the same values)\n")
            columns = ["tokens", "mb", "values", "op", "store_gbps", "plain_gbps", "ratio"]
            print(table(results["redis"], columns))
        if "shared" in sections:
            results["shared"] = bench_shared(1024 if args.quick else 4096, 8, args.redis_url, root)
            print("\n## Shared prefixes (8 agents, one prefix, 300 own tokens each)\n")
            columns = [
                "backend",
                "prefix_tokens",
                "referenced_mb",
                "written_mb",
                "saved_mb",
                "first_put_s",
                "later_put_s",
                "warm_start_get_s",
                "own_get_s",
                "warm_vs_own",
            ]
            print(table(results["shared"], columns))
        if "fork" in sections:
            tokens = 2048 + 100 if args.quick else 8192 + 100
            results["fork"] = [
                bench_fork(kind, tokens, args.forks, 64, repeat, args.redis_url, root)
                for kind in ("disk", "redis")
            ]
            print(f"\n## Forks vs copies ({tokens} tokens, median of {repeat}; then {args.forks} forks)\n")
            print(table(results["fork"], list(results["fork"][0])))
        if sections & {"resume", "quant"}:
            engine = load_engine()
            if "resume" in sections:
                contexts = [512, 1024] if args.quick else [512, 1024, 2048]
                runs = 2 if args.quick else 3
                results["resume_direct"] = bench_resume_direct(engine, contexts, runs, root)
                print("\n## Warm resume vs cold prefill: store + mlx-lm directly (the floor's method)\n")
                print(
                    table(
                        results["resume_direct"],
                        [
                            "context",
                            "cold_ttft_s",
                            "warm_ttft_s",
                            "store_get_s",
                            "speedup",
                            "floor_speedup",
                            "vs_floor",
                            "first_token_identical",
                        ],
                    )
                )
                results["resume"] = bench_resume(engine, contexts, runs, root)
                print("\n## Warm resume vs cold prefill through the engine (BlockPoolBatchEngine)\n")
                print(
                    table(
                        results["resume"],
                        [
                            "context",
                            "cache_mb",
                            "cold_ttft_s",
                            "warm_ttft_s",
                            "store_get_s",
                            "speedup",
                            "warm_hot_ttft_s",
                            "speedup_hot",
                            "floor_speedup",
                            "vs_floor",
                            "first_token_identical",
                        ],
                    )
                )
            if "quant" in sections:
                results["quant"] = bench_quant(engine, root)
                print("\n## Quantization at rest (3 prompts, 64 greedy tokens after resume)\n")
                print(
                    table(
                        results["quant"],
                        [
                            "quantization",
                            "group_size",
                            "bytes_per_1k_tokens",
                            "vs_none",
                            "identical_prompts",
                            "prompts",
                            "first_divergence",
                            "token_agreement",
                            "identical_to_fresh_prefill",
                        ],
                    )
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    run_info["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    previous = json.loads(out.read_text()) if out.exists() else {}
    previous.update(results)
    for legacy in ("command", "openblas_preloaded"):  # per-run details now live under "runs"
        previous.pop(legacy, None)
    runs = previous.setdefault("runs", {})
    for section in sections & set(results):
        runs[section] = run_info
    if "resume" in sections:
        runs["resume_direct"] = run_info
    out.write_text(json.dumps(previous, indent=2) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    ensure_fast_blas(sys.argv)
    raise SystemExit(main())
