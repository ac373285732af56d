"""Engine benchmarks: block gather/extract vs memcpy, pool alloc/free, engine vs raw BatchGenerator.

Run: python benchmarks/bench_engine.py [--quick]   (re-execs itself with OpenBLAS on Linux)
Writes benchmarks/results/engine.json and prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.fastpath import ensure_fast_blas  # noqa: E402
from engine.params import SamplingParams

RESULTS = Path(__file__).parent / "results" / "engine.json"


def timed(fn: Any, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def p95(samples: list[float]) -> float:
    return sorted(samples)[max(0, int(len(samples) * 0.95) - 1)]


def bench_blocks(repeat: int) -> list[dict[str, Any]]:
    """Steady state, as in a worker that resumes and finishes agents all day: gather takes its
    cache buffers from the engine's KVArena (a finished sequence gives them back), extract
    copies into BlockSlab slots that earlier, dropped caches used. Copy, gather and extract
    alternate in every round, so the machine's noise hits all three alike."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import KVCache

    from engine.blocks import AgentCache
    from engine.host_slab import BlockSlab
    from engine.kv_arena import KVArena
    from engine.kv_convert import blocks_to_caches, caches_to_blocks, keep_buffers_resident
    from engine.spec import LayerSpec, ModelCacheSpec

    keep_buffers_resident(2 << 30)  # as the engine does for its pool
    rows = []
    for label, n_layers in (("smollm2 (30 layers)", 30), ("48-layer", 48)):
        spec = ModelCacheSpec(label, n_layers, (LayerSpec("full"),) * n_layers, 3, 64, 64, "float32")
        for n_tokens in (2048, 4096, 8192):
            layers = []
            for _ in range(n_layers):
                layer = KVCache()
                keys, values = mx.random.normal((1, 3, n_tokens, 64)), mx.random.normal((1, 3, n_tokens, 64))
                layer.state = (keys, values, n_tokens)
                layers.append(layer)
            mx.eval([c.state[:2] for c in layers])
            tokens = list(range(n_tokens))
            slab = BlockSlab(spec.bytes_per_block(), max_idle_slots=4 * spec.blocks_for(n_tokens))
            arena = KVArena(spec, max_idle_bytes=2 * n_tokens * spec.bytes_per_token())
            cache: AgentCache = caches_to_blocks(layers, tokens, spec, slab)
            nbytes = cache.nbytes
            src = np.random.rand(nbytes // 8)
            dst = np.empty_like(src)

            def gather(c: AgentCache = cache, n: int = n_tokens, a: KVArena = arena) -> list[Any]:
                return blocks_to_caches(c, n, arena=a)

            def extract(
                ls: list[Any] = layers, t: list[int] = tokens, sp: ModelCacheSpec = spec, sl: BlockSlab = slab
            ) -> AgentCache:
                return caches_to_blocks(ls, t, sp, sl)

            first_gather, first_extract = timed(gather, 1)[0], timed(extract, 1)[0]
            copy, gathers, extracts = [], [], []
            for _ in range(repeat):
                copy += timed(lambda s=src, d=dst: np.copyto(d, s), 1)
                start = time.perf_counter()
                rebuilt = gather()
                gathers.append(time.perf_counter() - start)
                arena.give_back([(c.keys, c.values) for c in rebuilt])  # the sequence ended
                del rebuilt
                extracts += timed(extract, 1)
            rows.append(
                {
                    "spec": label,
                    "tokens": n_tokens,
                    "mb": round(nbytes / 1e6, 1),
                    "copy_ms_p50": ms(statistics.median(copy)),
                    "copy_ms_p95": ms(p95(copy)),
                    "gather_first_ms": ms(first_gather),
                    "gather_ms_p50": ms(statistics.median(gathers)),
                    "gather_ms_p95": ms(p95(gathers)),
                    "extract_first_ms": ms(first_extract),
                    "extract_ms_p50": ms(statistics.median(extracts)),
                    "extract_ms_p95": ms(p95(extracts)),
                    "gather_vs_copy_p50": round(statistics.median(copy) / statistics.median(gathers), 2),
                    "gather_vs_copy_p95": round(p95(copy) / p95(gathers), 2),
                    "extract_vs_copy_p50": round(statistics.median(copy) / statistics.median(extracts), 2),
                    "extract_vs_copy_p95": round(p95(copy) / p95(extracts), 2),
                }
            )
            print(rows[-1], flush=True)
    return rows


def ms(seconds: float) -> float:
    return round(seconds * 1e3, 2)


def bench_pool() -> dict[str, float]:
    from engine.blocks import BlockPool

    pool = BlockPool(4096)
    alloc, free = [], []
    for i in range(1000):
        start = time.perf_counter()
        pool.allocate(i, 32)
        mid = time.perf_counter()
        pool.free(i)
        alloc.append(mid - start)
        free.append(time.perf_counter() - mid)
    return {
        "cycles": 1000,
        "blocks_per_allocation": 32,
        "allocate_us_p50": round(statistics.median(alloc) * 1e6, 2),
        "allocate_us_max": round(max(alloc) * 1e6, 2),
        "free_us_p50": round(statistics.median(free) * 1e6, 2),
        "free_us_max": round(max(free) * 1e6, 2),
    }


def bench_throughput(concurrency: list[int], max_tokens: int) -> list[dict[str, Any]]:
    from mlx_lm.generate import BatchGenerator

    from engine.engine import BlockPoolBatchEngine
    from engine.model import load_model

    model, tokenizer = load_model("smollm2-135m")
    topics = ["the sea", "a mountain", "coffee", "a robot", "winter", "a library", "trains", "the moon"]
    rows = []
    for n in concurrency:
        prompts = [
            list(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": f"Write a short story about {topics[i % 8]} (#{i})."}],
                    add_generation_prompt=True,
                )
            )
            for i in range(n)
        ]

        def raw(n: int = n, prompts: list[list[int]] = prompts) -> int:
            gen = BatchGenerator(
                model, completion_batch_size=n, prefill_batch_size=min(8, n), prefill_step_size=512
            )
            gen.insert(prompts, max_tokens=[max_tokens] * n)
            count = 0
            live = n
            while live:
                for r in gen.next_generated():
                    count += 1
                    live -= r.finish_reason is not None
            gen.close()
            return count

        def ours(n: int = n, prompts: list[list[int]] = prompts) -> int:
            eng = BlockPoolBatchEngine(model, tokenizer, model_name="smollm2-135m", max_batch=n)
            for p in prompts:
                eng.submit(None, p, SamplingParams(max_tokens=max_tokens, stop_tokens=()))
            count = 0
            while eng.has_work():
                count += len(eng.step().deltas)
            eng.close()
            return count

        raw()  # warm-up
        results: dict[str, list[float]] = {"raw": [], "engine": []}
        tokens: dict[str, int] = {}
        for _ in range(2):  # interleave to share the machine's noise
            for name, fn in (("raw", raw), ("engine", ours)):
                start = time.perf_counter()
                tokens[name] = fn()
                results[name].append(tokens[name] / (time.perf_counter() - start))
        raw_tps, eng_tps = max(results["raw"]), max(results["engine"])
        rows.append(
            {
                "concurrency": n,
                "max_tokens": max_tokens,
                "raw_tokens": tokens["raw"],
                "engine_tokens": tokens["engine"],
                "raw_tok_s": round(raw_tps, 1),
                "engine_tok_s": round(eng_tps, 1),
                "ratio": round(eng_tps / raw_tps, 3),
            }
        )
        print(rows[-1], flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    ensure_fast_blas()
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer repeats, fewer tokens")
    parser.add_argument("--blocks-only", action="store_true", help="skip the model throughput part")
    args = parser.parse_args()
    repeat = 5 if args.quick else 15
    blocks = bench_blocks(repeat)
    print(table(blocks), flush=True)
    pool = bench_pool()
    print(table([pool]), flush=True)
    if args.blocks_only:
        return
    throughput = bench_throughput([1, 4, 16], 32 if args.quick else 64)
    print(table(throughput))
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"blocks": blocks, "pool": pool, "throughput": throughput}, indent=2))


if __name__ == "__main__":
    main()
