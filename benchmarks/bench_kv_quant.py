"""Quantized KV in the pool (`kv_bits`): what it costs in quality and what it buys in capacity.

Run: python benchmarks/bench_kv_quant.py [--only quality|capacity|prefill] [--quick] [--model ID]
(re-execs itself with OpenBLAS on Linux). Writes benchmarks/results/kv_quant.json and prints
markdown tables.

quality, per model (the builtin SmolLM2-135M; tiny random-weight llama and qwen3 of the tests,
benchmarks/tiny_models.py) and per bit width, against the unquantized engine:
- greedy agreement: PROMPTS run through BlockPoolBatchEngine with and without kv_bits, 32 new
  tokens each: the share of generated tokens before the first difference, and prompts equal throughout;
- |log-prob difference| of the chosen token (mean, max) over the positions where both engines saw
  the same context and chose the same token (before the first difference);
- perplexity of benchmarks/data/declaration.txt (public domain), teacher-forced in 256-token chunks
  with mlx-lm's KVCache / QuantizedKVCache: the same rule as the engine's prefill (each chunk's K/V
  quantized before it is attended).

capacity, the builtin model: 16 rows, each resuming a 2,048-token cache and decoding, for none /
q8 / q4 (group size 64) in one run, interleaved round by round: median decode step, tokens/s, the
step ratio to none, a cold 1,024-token prompt's prefill alone (ratio to none), and how many 2K
agents (2,048 + 256 tokens of room) a 2 GiB pool holds.

prefill: a cold 1,025-token prompt alone, none / q8 / q4 interleaved over six rounds (every sample
kept): its chunks unpack their row's K/V to float32 in C before attending (engine/cpu/quantized_attention.py).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import machine, write_json  # noqa: E402
from engine.cpu.blas import ensure_fast_blas  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "kv_quant.json"
TEXT = Path(__file__).parent / "data" / "declaration.txt"
PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a paperclip.",
    "Summarize the plot of Romeo and Juliet.",
    "How do I boil an egg?",
    "Translate 'good morning' into Spanish and German.",
    "What is 17 times 23? Show your steps.",
]
NEW_TOKENS = 32
CHUNK = 256
PREFILL = 1024
MODES: list[int | None] = [None, 8, 4]


def _label(bits: int | None) -> str:
    return "none" if bits is None else f"q{bits}"


# ---- quality ---------------------------------------------------------------------------------


def _models(
    quick: bool, name: str | None
) -> list[tuple[str, Any, Any, list[list[int]], list[tuple[int, int]]]]:
    """(name, model, tokenizer, prompt token lists, (bits, group size) settings) for each model."""
    from benchmarks.tiny_models import QUANTIZABLE, ByteTokenizer, tiny_model
    from engine.models.load import load_model

    model, tokenizer = load_model(name) if name else load_model()
    chat = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
        for p in PROMPTS
    ]
    out = [(name or "SmolLM2-135M (builtin)", model, tokenizer, chat, [(8, 64), (4, 64), (4, 32)])]
    for arch in () if quick else ("llama", "qwen3"):
        tiny = tiny_model(arch, **QUANTIZABLE[arch])
        prompts = [list(p.encode()) for p in PROMPTS]
        out.append((f"tiny {arch} (random)", tiny, ByteTokenizer(), prompts, [(8, 32), (4, 32)]))
    return out


def _generate(
    model: Any, tokenizer: Any, prompts: list[list[int]], bits: int | None, group: int
) -> list[Any]:
    from engine.batch.engine import BlockPoolBatchEngine
    from engine.core.params import SamplingParams

    engine = BlockPoolBatchEngine(
        model,
        _NoEos(tokenizer),
        model_name="bench",
        pool_mb=512,
        max_batch=len(prompts),
        kv_bits=bits,
        kv_group_size=group if bits else None,
    )
    params = SamplingParams(max_tokens=NEW_TOKENS, logprobs=True)
    uids = [engine.submit(None, p, params, keep_cache=False) for p in prompts]
    done: dict[int, Any] = {}
    while engine.has_work():
        for completion in engine.step().completions:
            done[completion.uid] = completion
    engine.close()
    return [done[uid] for uid in uids]


class _NoEos:
    """The tokenizer without its stop tokens: every prompt runs all NEW_TOKENS."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.eos_token_ids: frozenset[int] = frozenset()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


def _perplexity(model: Any, tokens: list[int], bits: int | None, group: int) -> float:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    n_layers = len(model.layers)
    caches: list[Any] = [
        KVCache() if bits is None else QuantizedKVCache(group_size=group, bits=bits) for _ in range(n_layers)
    ]
    total, count = 0.0, 0
    for start in range(0, len(tokens) - 1, CHUNK):
        chunk = tokens[start : start + CHUNK]
        targets = tokens[start + 1 : start + CHUNK + 1]
        logits = model(mx.array(chunk)[None], cache=caches)[0, : len(targets)].astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        picked = mx.take_along_axis(logprobs, mx.array(targets)[:, None], axis=-1)
        total -= float(picked.sum())
        count += len(targets)
    return math.exp(total / count)


def bench_quality(quick: bool, model_name: str | None = None) -> list[dict[str, Any]]:
    rows = []
    text = TEXT.read_text()
    for name, model, tokenizer, prompts, settings in _models(quick, model_name):
        text_tokens = list(text.encode()) if name.startswith("tiny") else list(tokenizer.encode(text))
        text_tokens = text_tokens[: 1024 if quick else 2048]
        reference = _generate(model, tokenizer, prompts, None, 0)
        base_ppl = _perplexity(model, text_tokens, None, 0)
        rows.append({"model": name, "kv": "none", "perplexity": base_ppl, "text_tokens": len(text_tokens)})
        for bits, group in settings:
            got = _generate(model, tokenizer, prompts, bits, group)
            agreed, diffs, equal = 0, [], 0
            for ref, out in zip(reference, got, strict=True):
                same = 0
                for a, b in zip(ref.token_ids, out.token_ids, strict=True):
                    if a != b:
                        break
                    same += 1
                agreed += same
                equal += same == len(ref.token_ids)
                diffs += [
                    abs(x.logprob - y.logprob)
                    for x, y in zip(ref.logprobs[:same], out.logprobs[:same], strict=True)
                ]
            ppl = _perplexity(model, text_tokens, bits, group)
            rows.append(
                {
                    "model": name,
                    "kv": f"q{bits}",
                    "group_size": group,
                    "agreement": agreed / sum(len(r.token_ids) for r in reference),
                    "prompts_equal": f"{equal}/{len(prompts)}",
                    "mean_abs_logprob_diff": statistics.fmean(diffs) if diffs else float("nan"),
                    "max_abs_logprob_diff": max(diffs) if diffs else float("nan"),
                    "perplexity": ppl,
                    "perplexity_change": ppl / base_ppl - 1,
                    "text_tokens": len(text_tokens),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


# ---- capacity --------------------------------------------------------------------------------


def _prefill_time(engine: Any, prompt: list[int]) -> float:
    """Seconds for a cold prompt alone to its first token (its chunks attend over the row's own K/V)."""
    from engine.core.params import SamplingParams

    start = time.perf_counter()
    engine.submit(None, prompt, SamplingParams(max_tokens=1), keep_cache=False)
    while engine.has_work():
        engine.step()
    return time.perf_counter() - start


def bench_prefill(quick: bool) -> list[dict[str, Any]]:
    """Cold prefill alone, none / q8 / q4 interleaved over more rounds than the capacity run's three."""
    from engine.batch.engine import BlockPoolBatchEngine
    from engine.models.load import load_model

    model, tokenizer = load_model()
    tokens = list(tokenizer.encode(TEXT.read_text() * 2))[:PREFILL]
    engines = {
        bits: BlockPoolBatchEngine(
            model,
            tokenizer,
            model_name="bench",
            pool_mb=512,
            kv_bits=bits,
            kv_group_size=64 if bits else None,
        )
        for bits in MODES
    }
    times: dict[int | None, list[float]] = {bits: [] for bits in MODES}
    for round_ in range(3 if quick else 6):
        for bits, engine in engines.items():
            times[bits].append(_prefill_time(engine, [300 + round_, *tokens]))
    base = statistics.median(times[None])
    out = [
        {
            "kv": _label(bits),
            "prompt": PREFILL + 1,
            "prefill_s": times[bits],
            "ratio": statistics.median(times[bits]) / base,
        }
        for bits in MODES
    ]
    for row in out:
        print(json.dumps(row), flush=True)
    return out


def bench_capacity(quick: bool) -> list[dict[str, Any]]:
    from engine.batch.engine import BlockPoolBatchEngine
    from engine.core.params import SamplingParams
    from engine.models.load import load_model

    rows_n, context = 16, 2048
    steps, rounds = (4, 2) if quick else (8, 3)
    model, tokenizer = load_model()
    text = TEXT.read_text()
    tokens = list(tokenizer.encode(text * 4))[:context]
    engines = {
        bits: BlockPoolBatchEngine(
            model,
            _NoEos(tokenizer),
            model_name="bench",
            pool_mb=2048,
            max_batch=rows_n,
            kv_bits=bits,
            kv_group_size=64 if bits else None,
        )
        for bits in MODES
    }
    # One 2K cache, prefilled once at full precision; each pool converts it once to its precision.
    first = engines[None]
    uid = first.submit("a", tokens, SamplingParams(max_tokens=1))
    cache = None
    while first.has_work():
        for completion in first.step().completions:
            if completion.uid == uid:
                cache = completion.cache
    assert cache is not None
    caches = {bits: engine.pool_precision(cache) for bits, engine in engines.items()}
    samples: dict[int | None, list[float]] = {bits: [] for bits in MODES}
    prefills: dict[int | None, list[float]] = {bits: [] for bits in MODES}
    for round_ in range(rounds):
        for bits, engine in engines.items():
            prefills[bits].append(_prefill_time(engine, [200 + round_, *tokens[:PREFILL]]))
            prompts = [cache.token_ids + [100 + row] for row in range(rows_n)]
            uids = [
                engine.submit(f"r{row}", p, SamplingParams(max_tokens=steps + 4), cache=caches[bits])
                for row, p in enumerate(prompts)
            ]
            engine.step()  # every row's suffix: its first token
            for _ in range(steps):
                start = time.perf_counter()
                engine.step()
                samples[bits].append(time.perf_counter() - start)
            for uid in uids:
                engine.cancel(uid)
            while engine.has_work():
                engine.step()
    out = []
    base = statistics.median(samples[None])
    base_prefill = statistics.median(prefills[None])
    for bits, engine in engines.items():
        step = statistics.median(samples[bits])
        blocks_per_agent = engine.spec.blocks_for(context + 256)
        out.append(
            {
                "kv": _label(bits),
                "rows": rows_n,
                "context": context,
                "median_step_s": step,
                "tokens_per_s": rows_n / step,
                "step_ratio": step / base,
                "prefill_1k_s": statistics.median(prefills[bits]),
                "prefill_ratio": statistics.median(prefills[bits]) / base_prefill,
                "block_bytes": engine.block_bytes,
                "pool_blocks_2gib": engine.pool.total_blocks,
                "agents_2k_fit_2gib": engine.pool.total_blocks // blocks_per_agent,
                "cache_bytes_2k": caches[bits].nbytes,
            }
        )
        print(json.dumps(out[-1]), flush=True)
        engine.close()
    return out


def main() -> None:
    ensure_fast_blas()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("quality", "capacity", "prefill"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", help="quality: this model (mlx-lm id or folder) instead of the builtin")
    args = parser.parse_args()
    results: dict[str, Any] = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    if args.only in (None, "quality"):
        results["quality"] = bench_quality(args.quick, args.model)
    if args.only in (None, "capacity"):
        results["capacity"] = bench_capacity(args.quick)
    if args.only in (None, "prefill"):
        results["prefill"] = bench_prefill(args.quick)
    write_json(RESULTS, {"machine": machine(), **results})


if __name__ == "__main__":
    main()
