"""Engine benchmarks: block gather/extract vs memcpy, pool alloc/free, engine vs raw BatchGenerator.

Run: python benchmarks/bench_engine.py [--quick] [--only blocks|throughput|joins|joins-families|finish|rows]
(re-execs itself with OpenBLAS on Linux)
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

from benchmarks.common import table  # noqa: E402
from engine.core.params import SamplingParams
from engine.cpu.blas import ensure_fast_blas  # noqa: E402

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

    from engine.core.blocks import AgentCache
    from engine.core.spec import LayerSpec, ModelCacheSpec
    from engine.kv.arena import KVArena
    from engine.kv.buffers import keep_buffers_resident
    from engine.kv.convert import blocks_to_caches, caches_to_blocks
    from engine.kv.host_slab import BlockSlab

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
    from engine.core.blocks import BlockPool

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

    from engine.batch.engine import BlockPoolBatchEngine
    from engine.models.load import load_model

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

        def ours(n: int = n, prompts: list[list[int]] = prompts, keep_cache: bool = False) -> int:
            eng = BlockPoolBatchEngine(model, tokenizer, model_name="smollm2-135m", max_batch=n)
            for p in prompts:
                eng.submit(
                    None, p, SamplingParams(max_tokens=max_tokens, stop_tokens=()), keep_cache=keep_cache
                )
            count = 0
            while eng.has_work():
                count += len(eng.step().deltas)
            eng.close()
            return count

        def ours_cut(n: int = n, prompts: list[list[int]] = prompts) -> int:
            return ours(n, prompts, keep_cache=True)

        raw()  # warm-up
        runs = (("raw", raw), ("engine", ours), ("engine_cut", ours_cut))
        results: dict[str, list[float]] = {name: [] for name, _ in runs}
        tokens: dict[str, int] = {}
        for _ in range(3):  # interleave to share the machine's noise
            for name, fn in runs:
                start = time.perf_counter()
                tokens[name] = fn()
                results[name].append(tokens[name] / (time.perf_counter() - start))
        best = {name: max(values) for name, values in results.items()}
        rows.append(
            {
                "concurrency": n,
                "max_tokens": max_tokens,
                "raw_tokens": tokens["raw"],
                "engine_tokens": tokens["engine"],
                "raw_tok_s": round(best["raw"], 1),
                "engine_tok_s": round(best["engine"], 1),
                "ratio": round(best["engine"] / best["raw"], 3),
                "engine_cut_tok_s": round(best["engine_cut"], 1),
                "ratio_cut": round(best["engine_cut"] / best["raw"], 3),
            }
        )
        print(rows[-1], flush=True)
    return rows


class _NoEos:
    """The tokenizer without end-of-sequence ids: synthetic caches hold random KV, and a
    sequence that happened to sample EOS would leave the batch mid-measurement."""

    eos_token_ids: frozenset[int] = frozenset()

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


def synthetic_cache(spec: Any, n_tokens: int, seed: int, model: Any = None) -> Any:
    """An agent cache of n_tokens with random K/V (and random SSM state, for a model with state
    layers: pass it): timing depends on sizes, not on values (a sliding layer's blocks keep its
    window of them, a state layer the checkpoint at the end, as a real cache's would)."""
    import mlx.core as mx
    from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, make_prompt_cache

    from engine.kv.buffers import MLX_DTYPE
    from engine.kv.convert import caches_to_blocks

    mx.random.seed(seed)
    kv_specs, state_specs = iter(spec.kv_layers()), iter(spec.state_layers())

    def filled(cache: Any) -> Any:
        if isinstance(cache, CacheList):
            return CacheList(*(filled(member) for member in cache.caches))
        if isinstance(cache, ArraysCache):
            state = next(state_specs)
            arrays: list[Any] = [
                mx.random.normal((1, *shape)).astype(MLX_DTYPE[dtype]) * 0.1
                for shape, dtype in zip(state.shapes, state.dtypes, strict=True)
            ]
            mx.eval(arrays)
            cache.cache = arrays
            return cache
        kv = next(kv_specs)
        layer = KVCache()
        shape = (1, kv.n_kv_heads, n_tokens, kv.k_head_dim)
        value_shape = (1, kv.n_kv_heads, n_tokens, kv.v_head_dim)
        layer.state = (mx.random.normal(shape) * 0.5, mx.random.normal(value_shape) * 0.5, n_tokens)
        mx.eval(layer.state[:2])
        return layer

    structure = make_prompt_cache(model) if model is not None else [KVCache() for _ in spec.kv_layers()]
    layers = [filled(cache) for cache in structure]
    tokens = [(1000 + 37 * i) % 40000 + 100 for i in range(n_tokens)]
    return caches_to_blocks(layers, tokens, spec)


def short_prompts(tokenizer: Any, n: int) -> list[list[int]]:
    return [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": f"Tell me a long story about object number {i}."}],
                add_generation_prompt=True,
            )
        )
        for i in range(n)
    ]


# A Gemma-3-shaped model at SmolLM2's scale (random weights: no Gemma weights can be downloaded
# here): Gemma 3's layer pattern (5 sliding layers of window 512, then a global one, as Gemma-3-1B),
# one KV head of head dim 128, SmolLM2's hidden size, MLP width and vocabulary (its tokenizer drives it).
GEMMA3_SHAPED: dict[str, Any] = {
    "model_type": "gemma3_text",
    "hidden_size": 576,
    "num_hidden_layers": 24,
    "intermediate_size": 1536,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "query_pre_attn_scalar": 128,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "vocab_size": 49152,
    "rms_norm_eps": 1e-6,
}


# A Qwen3-Next-shaped hybrid at SmolLM2's scale (random weights): 3 of every 4 layers Gated DeltaNet
# linear attention (fixed-size state per row), every 4th full attention, mixture-of-experts MLPs.
QWEN3_NEXT_SHAPED: dict[str, Any] = {
    "model_type": "qwen3_next",
    "hidden_size": 576,
    "num_hidden_layers": 24,
    "intermediate_size": 1536,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "full_attention_interval": 4,
    "linear_num_value_heads": 8,
    "linear_num_key_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "shared_expert_intermediate_size": 512,
    "mlp_only_layers": [],
    "moe_intermediate_size": 512,
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.25,
    "max_position_embeddings": 8192,
    "vocab_size": 49152,
    "rms_norm_eps": 1e-6,
}
SHAPED = {"gemma3-shaped": GEMMA3_SHAPED, "qwen3_next-shaped": QWEN3_NEXT_SHAPED}


def shaped_model(config: dict[str, Any]) -> Any:
    import mlx.core as mx
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(config))
    mx.eval(model.parameters())
    return model


def join_setup(family: str, n_short: int) -> tuple[Any, Any, list[list[int]], list[int]]:
    """The model (SmolLM2 or one of SHAPED), its tokenizer without EOS, n_short chat prompts and the
    joiner's 17-token suffix."""
    from engine.models.load import load_model

    model, tokenizer = load_model("smollm2-135m")
    if family in SHAPED:
        model = shaped_model(SHAPED[family])
    shorts = short_prompts(tokenizer, n_short)
    suffix = list(tokenizer.encode(" And now, please continue the story where we left it."))[:17]
    return model, _NoEos(tokenizer), shorts, suffix


def bench_joins(
    joins: list[tuple[int, ...]], n_short: int, window: int, family: str = "smollm2-135m"
) -> list[dict[str, Any]]:
    """n_short sequences decoding, then agents with cached KV (and a 17-token suffix) join.

    The engine (ragged batch) and raw mlx-lm BatchGenerator run side by side, one step each
    in turn, so the machine's noise hits both alike. Per side: the batch's median step
    without the joiners (before they join and after they are removed), the median step
    with them, and how many steps / how long until each joiner's first token (also in units
    of the median step without them). `family`: the builtin SmolLM2, or one of SHAPED (random
    weights, SmolLM2's tokenizer)."""
    model, no_eos, shorts, suffix = join_setup(family, n_short)
    params = SamplingParams(max_tokens=1000, stop_tokens=())
    join_params = SamplingParams(max_tokens=100, stop_tokens=())
    context = 8192  # SmolLM2's: the largest joiner is cut to fit its suffix and output
    rows = []
    for sizes in joins:
        sizes = tuple(min(n, context - len(suffix) - join_params.max_tokens) for n in sizes)
        caches = [synthetic_cache_for(model, size, seed, family) for seed, size in enumerate(sizes)]
        drivers: dict[str, _EngineDriver | _RawDriver] = {
            "engine": _EngineDriver(model, no_eos, shorts, suffix, params, join_params, family),
            "raw": _RawDriver(model, shorts, suffix, params.max_tokens, join_params.max_tokens),
        }
        for driver in drivers.values():
            while len(driver.step()) < n_short:
                pass
        without: dict[str, list[float]] = {kind: [] for kind in drivers}
        with_joiners: dict[str, list[float]] = {kind: [] for kind in drivers}

        def window_of(into: dict[str, list[float]], drivers: dict[str, Any] = drivers) -> None:
            for _ in range(window):
                for kind, driver in drivers.items():
                    into[kind] += timed(driver.step, 1)

        window_of(without)
        started: dict[str, float] = {}
        joined: dict[str, list[int]] = {}
        first: dict[str, dict[int, tuple[int, float]]] = {kind: {} for kind in drivers}
        for kind, driver in drivers.items():
            started[kind] = time.perf_counter()
            joined[kind] = [driver.join(c) for c in caches]
            steps = 0
            while len(first[kind]) < len(caches) and steps < 50:
                got = driver.step()
                steps += 1
                for uid in joined[kind]:
                    if uid in got and uid not in first[kind]:
                        first[kind][uid] = (steps, time.perf_counter() - started[kind])
        window_of(with_joiners)
        for kind, driver in drivers.items():
            for uid in joined[kind]:
                driver.remove(uid)
        window_of(without)
        solo = solo_first_token_s(model, no_eos, caches, suffix, join_params, family)
        row: dict[str, Any] = {"model": family, "joiners": "+".join(str(n) for n in sizes)}
        for kind, driver in drivers.items():
            driver.close()
            base = statistics.median(without[kind])
            row[f"{kind}_step_ms_without"] = ms(base)
            row[f"{kind}_step_ms_with"] = ms(statistics.median(with_joiners[kind]))
            row[f"{kind}_step_ratio"] = round(statistics.median(with_joiners[kind]) / base, 2)
            row[f"{kind}_first_token_steps"] = max(n for n, _ in first[kind].values())
            worst = max(t for _, t in first[kind].values())
            row[f"{kind}_first_token_ms"] = ms(worst)
            row[f"{kind}_first_token_in_steps"] = round(worst / base, 1)
        # The joiners' own work: the same caches resumed on an idle engine (no batch mates).
        row["solo_first_token_ms"] = ms(solo)
        row["solo_first_token_in_steps"] = round(solo / statistics.median(without["engine"]), 1)
        print(row, flush=True)
        rows.append(row)
    return rows


def bench_join_twins(family: str, n_short: int, size: int, rounds: int) -> dict[str, Any]:
    """The same tax as bench_joins measures, robust to a busy machine: per backend two twin batches of
    n_short decoding rows, one joined by a `size`-token agent, stepped in turn (ABBA) in the same
    minutes, so that load that comes and goes hits both alike. Ratio = the joined twin's median step /
    the other's; engine_vs_raw = the engine's joined step / BatchGenerator's."""
    model, no_eos, shorts, suffix = join_setup(family, n_short)
    params = SamplingParams(max_tokens=1000, stop_tokens=())
    join_params = SamplingParams(max_tokens=1000, stop_tokens=())
    cache = synthetic_cache_for(model, size, 0, family)
    twins: dict[str, list[_EngineDriver | _RawDriver]] = {
        "engine": [
            _EngineDriver(model, no_eos, shorts, suffix, params, join_params, family) for _ in range(2)
        ],
        "raw": [
            _RawDriver(model, shorts, suffix, params.max_tokens, join_params.max_tokens) for _ in range(2)
        ],
    }
    for pair in twins.values():
        for driver in pair:
            while len(driver.step()) < n_short:
                pass
        joiner = pair[1].join(cache)
        while joiner not in pair[1].step():
            pass
    times: dict[str, list[list[float]]] = {kind: [[], []] for kind in twins}
    for r in range(rounds):
        for kind, pair in twins.items():
            for i in (0, 1) if r % 2 == 0 else (1, 0):
                times[kind][i] += timed(pair[i].step, 1)
    row: dict[str, Any] = {"model": family, "joiner": size}
    for kind, pair in twins.items():
        base, joined = (statistics.median(t) for t in times[kind])
        row[f"{kind}_step_ms"] = ms(base)
        row[f"{kind}_step_ms_joined"] = ms(joined)
        row[f"{kind}_ratio"] = round(joined / base, 2)
        for driver in pair:
            driver.close()
    row["engine_vs_raw_joined"] = round(row["engine_step_ms_joined"] / row["raw_step_ms_joined"], 2)
    print(row, flush=True)
    return row


def solo_first_token_s(
    model: Any, tokenizer: Any, caches: list[Any], suffix: list[int], params: Any, name: str
) -> float:
    """Seconds from submit to the first token of `caches` (+ `suffix`) on an engine running nothing else,
    median of 3 (the first, which pays fresh buffers, is dropped)."""
    from engine.batch.engine import BlockPoolBatchEngine

    engine = BlockPoolBatchEngine(model, tokenizer, model_name=name, pool_mb=6000)
    times = []
    for _ in range(4):
        started = time.perf_counter()
        uids = [engine.submit("agent", c.token_ids + suffix, params, cache=c) for c in caches]
        waiting = set(uids)
        while waiting:
            waiting -= {d.uid for d in engine.step().deltas}
        times.append(time.perf_counter() - started)
        for uid in uids:
            engine.cancel(uid)
    engine.close()
    return statistics.median(times[1:])


class _EngineDriver:
    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        shorts: list[list[int]],
        suffix: list[int],
        params: Any,
        join_params: Any,
        name: str,
    ) -> None:
        from engine.batch.engine import BlockPoolBatchEngine

        self.engine = BlockPoolBatchEngine(model, tokenizer, model_name=name, pool_mb=6000)
        if not self.engine.ragged:
            raise RuntimeError(f"{name} does not run on the ragged batch")
        self.suffix, self.join_params = suffix, join_params
        for p in shorts:
            self.engine.submit(None, p, params)

    def step(self) -> set[int]:
        return {d.uid for d in self.engine.step().deltas}

    def join(self, cache: Any) -> int:
        return self.engine.submit("agent", cache.token_ids + self.suffix, self.join_params, cache=cache)

    def remove(self, uid: int) -> None:
        self.engine.cancel(uid)

    def close(self) -> None:
        self.engine.close()


class _RawDriver:
    """mlx-lm's BatchGenerator as the issue measured it: the joiner's KVCache goes in with insert."""

    def __init__(
        self, model: Any, shorts: list[list[int]], suffix: list[int], max_tokens: int, join_max_tokens: int
    ) -> None:
        from mlx_lm.generate import BatchGenerator

        self.generator = BatchGenerator(
            model, completion_batch_size=16, prefill_batch_size=8, prefill_step_size=512
        )
        self.generator.insert(shorts, max_tokens=[max_tokens] * len(shorts))
        self.suffix, self.max_tokens = suffix, join_max_tokens

    def step(self) -> set[int]:
        import mlx.core as mx
        from mlx_lm.generate import generation_stream

        responses = self.generator.next()[1]
        # next() leaves the next step computing on its own stream: count it here, not in the engine's time
        mx.synchronize(generation_stream)
        return {r.uid for r in responses}

    def join(self, cache: Any) -> int:
        from engine.kv.convert import blocks_to_caches

        layers = blocks_to_caches(cache, cache.n_tokens)
        (uid,) = self.generator.insert(
            [self.suffix], max_tokens=[self.max_tokens], caches=[layers], all_tokens=[list(cache.token_ids)]
        )
        return int(uid)

    def remove(self, uid: int) -> None:
        self.generator.remove([uid])

    def close(self) -> None:
        self.generator.close()


def synthetic_cache_for(model: Any, n_tokens: int, seed: int, name: str = "smollm2-135m") -> Any:
    from engine.models.cache_layout import spec_from_model

    return synthetic_cache(spec_from_model(model, name), n_tokens, seed, model)


def bench_finish_burst(n_rows: int, n_tokens: int, max_tokens: int, n_running: int = 4) -> dict[str, Any]:
    """n_running short sequences keep decoding while n_rows agents with n_tokens cached each
    all end at the same step. The longest step of the running batch from that step until
    every completion (its cache cut into blocks) has come out, against the median step
    before; the same with keep_cache=False (nothing to cut). Two bursts: the first cuts into
    fresh memory, the second into BlockSlab slots the first burst's dropped caches gave back
    (a worker's steady state once its store has written and dropped earlier caches)."""
    import numpy as np

    from engine.batch.engine import BlockPoolBatchEngine
    from engine.models.load import load_model

    model, tokenizer = load_model("smollm2-135m")
    cache = synthetic_cache_for(model, n_tokens, 0)
    result: dict[str, Any] = {"ending_rows": n_rows, "tokens_each": n_tokens, "running_rows": n_running}
    src = np.random.rand(n_rows * cache.nbytes // 8)
    dst = np.empty_like(src)
    copies: list[float] = []
    for keep in (True, False):
        eng = BlockPoolBatchEngine(model, _NoEos(tokenizer), model_name="smollm2-135m", pool_mb=6000)
        running = [
            eng.submit(None, p, SamplingParams(max_tokens=1000)) for p in short_prompts(tokenizer, n_running)
        ]
        while len(eng.step().deltas) < n_running:
            pass
        for burst in ("first", "steady"):
            before = timed(eng.step, 5)
            ending = {
                eng.submit(
                    f"a{i}",
                    cache.token_ids + [100 + i],
                    SamplingParams(max_tokens=max_tokens),
                    cache=cache,
                    keep_cache=keep,
                )
                for i in range(n_rows)
            }
            copies += timed(lambda: np.copyto(dst, src), 1)  # the same bytes, warm memory, same moment
            eng.step()  # the agents join (their gather ran in submit) and get their first tokens
            during, steps, cut = [], 0, 0  # from here: their last tokens, then their caches cut
            while ending:
                start = time.perf_counter()
                out = eng.step()
                during.append(time.perf_counter() - start)
                steps += 1
                assert set(running) <= {d.uid for d in out.deltas}, "a running sequence missed a step"
                for completion in out.completions:
                    ending.discard(completion.uid)
                    cut += completion.cache.nbytes if completion.cache is not None else 0
                del out
            label = "cut" if keep else "no_cut"
            result[f"{label}_{burst}_median_step_ms"] = ms(statistics.median(before))
            result[f"{label}_{burst}_longest_step_ms"] = ms(max(during))
            result[f"{label}_{burst}_steps_to_all_completions"] = steps  # max_tokens - 1 at least
            if keep:
                result["mb_cut"] = round(cut / 1e6, 1)
        for uid in running:
            eng.cancel(uid)
        eng.close()
    result["memcpy_ms_same_bytes"] = ms(statistics.median(copies))
    for burst in ("first", "steady"):
        longest, median = result[f"cut_{burst}_longest_step_ms"], result[f"cut_{burst}_median_step_ms"]
        result[f"{burst}_longest_vs_median_step"] = round(longest / median, 2)
    print(result, flush=True)
    return result


def submit_warm_rows(engine: Any, base: list[int], n: int, max_tokens: int) -> list[int]:
    """Prefill `base` once, then submit `n` rows resumed from its cache (each `base` + 2 tokens
    of its own): a batch of warm agents as a worker sees it."""
    engine.submit("a", base, SamplingParams(max_tokens=1))
    cache = None
    while cache is None:
        cache = next((c.cache for c in engine.step().completions), None)
    params = SamplingParams(max_tokens=max_tokens)
    return [engine.submit("a", [*base, 100 + i, 200], params, cache=cache) for i in range(n)]


def bench_rows(row_counts: list[int], steps: int) -> list[dict[str, Any]]:
    """engine/cpu/gemm_rows.py's evidence: an MLP matmul of SmolLM2 at each row count, and whole
    decode steps of that many warm rows, padded and not, alternating in one engine."""
    import os

    import mlx.core as mx

    from engine.batch.engine import BlockPoolBatchEngine
    from engine.cpu.gemm_rows import padded_rows
    from engine.models.load import load_model

    model, tokenizer = load_model()
    gate = model.model.layers[0].mlp.gate_proj.weight  # (1536, 576)
    text = " ".join(f"item {i} is {['red', 'blue', 'green'][i % 3]}." for i in range(200))
    base = list(tokenizer.encode(text))[:200]
    out = []
    for n in row_counts:
        x = mx.random.normal((n, gate.shape[1]))
        mx.eval(x)
        matmul = timed(lambda x=x: mx.eval(x @ gate.T), 200)
        engine = BlockPoolBatchEngine(model, _NoEos(tokenizer), model_name="smollm2-135m", max_batch=64)
        submit_warm_rows(engine, base, n, max_tokens=steps + 10)
        for _ in range(4):
            engine.step()
        times: dict[str, list[float]] = {"1": [], "0": []}
        for k in range(steps):
            setting = "1" if k % 2 else "0"
            os.environ["KVRQ_PAD_ROWS"] = setting
            started = time.perf_counter()
            engine.step()
            times[setting].append(time.perf_counter() - started)
        os.environ.pop("KVRQ_PAD_ROWS")
        engine.close()
        padded, plain = statistics.median(times["1"]), statistics.median(times["0"])
        out.append(
            {
                "rows": n,
                "run_as": padded_rows(n),
                "mlp_matmul_ms": ms(statistics.median(matmul)),
                "step_ms_plain": ms(plain),
                "step_ms_padded": ms(padded),
                "speedup": round(plain / padded, 2),
            }
        )
        print(out[-1], flush=True)
    return out


def main() -> None:
    ensure_fast_blas()
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer repeats, fewer tokens")
    parts = ("blocks", "throughput", "joins", "joins-families", "finish", "rows")
    parser.add_argument("--only", choices=parts, action="append", help="run only these parts")
    args = parser.parse_args()
    only = set(args.only or parts)
    repeat = 5 if args.quick else 15
    results: dict[str, Any] = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    if "blocks" in only:
        results["blocks"] = bench_blocks(repeat)
        print(table(results["blocks"]), flush=True)
        results["pool"] = bench_pool()
        print(table([results["pool"]]), flush=True)
    if "throughput" in only:
        results["throughput"] = bench_throughput([1, 4, 16], 32 if args.quick else 64)
        print(table(results["throughput"]), flush=True)
    if "joins" in only:
        joins = [(1024,), (2048,), (4096,), (8192,), (2048, 4096)]
        results["joins"] = bench_joins(joins, n_short=8, window=5 if args.quick else 8)
        print(table(results["joins"]), flush=True)
    if "joins-families" in only:
        # A 2K agent joining 8 decoding rows, per model family on the ragged batch, SmolLM2 as the
        # reference in the same run: before/after the join, then twin batches stepped in turn.
        rows = []
        for family in ("smollm2-135m", *SHAPED):
            rows += bench_joins([(2048,)], n_short=8, window=5 if args.quick else 8, family=family)
        results["joins_families"] = rows
        print(table(rows), flush=True)
        twins = [bench_join_twins(f, 8, 2048, 10 if args.quick else 24) for f in ("smollm2-135m", *SHAPED)]
        results["joins_families_twins"] = twins
        print(table(twins), flush=True)
    if "finish" in only:
        results["finish_burst"] = bench_finish_burst(8, 2048, 6)
        print(table([results["finish_burst"]]), flush=True)
    if "rows" in only:
        counts = [1, 2, 3, 4, 8, 12, 16, 17, 20, 24, 31, 32]
        results["rows"] = bench_rows(counts, 20 if args.quick else 40)
        print(table(results["rows"]), flush=True)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
