"""Attention on the CPU, same inputs, same run.

`--only split`: MLX's fused call vs kvrq's split with numpy's softmax and with its C parts (the
softmax in C; a decoding row's whole attention in C), on the ragged step's shapes (a warm
agent's 17 suffix tokens over its history, a 256-token prefill chunk, one decoding row over a
long history, 16 slotted short rows): medians (ms), fused / numpy and numpy / C.

`--only decode`: a layer of decoding rows with their own K/V (12 rows of 760, 1500 and 4000
tokens; 16 slotted rows of 300), 30 layers' worth of buffers cycled so that K/V come from memory
as in a real step: MLX's split path vs the C loop (engine/cpu/native_attention.py) on 1 and 2
threads, ms a layer and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_engine import ms, timed  # noqa: E402

from engine.cpu.blas import ensure_fast_blas  # noqa: E402

SHAPES = [  # (name, batch, queries, keys, keep-mask lengths or None)
    ("17-token suffix over 1K", 1, 17, 1024, None),
    ("17-token suffix over 2K", 1, 17, 2048, None),
    ("17-token suffix over 4K", 1, 17, 4096, None),
    ("17-token suffix over 8K", 1, 17, 8192, None),
    ("256-token chunk, first", 1, 256, 256, None),
    ("256-token chunk over 768", 1, 256, 768, None),
    ("1 decoding row over 4K", 1, 1, 4096, None),
    ("16 slotted rows over <= 512", 16, 1, 512, True),
]


def median_ms(fn: Callable[[], object], repeat: int = 21) -> float:
    fn()  # the first call pays fresh buffers
    return ms(statistics.median(timed(fn, repeat)))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", choices=["split", "decode"], action="append")
    only = parser.parse_args().only or ["split", "decode"]
    ensure_fast_blas()
    if "split" in only:
        bench_split()
    if "decode" in only:
        bench_decode()


DECODE_LAYOUTS = [  # (name, rows, tokens, slotted)
    ("12 rows x 760 tokens", 12, 760, False),
    ("12 rows x 1500 tokens", 12, 1500, False),
    ("12 rows x 4000 tokens", 12, 4000, False),
    ("16 slotted rows x 300 tokens", 16, 300, True),
]


def bench_decode(layers: int = 30) -> None:
    import mlx.core as mx

    from engine.batch.attention import AttentionCall, attend
    from engine.cpu import native_attention
    from engine.cpu.shortcuts import cpu_shortcuts, in_ragged_step

    print(
        "| decoding rows | MLX split ms/layer | C, 1 thread | C, 2 threads | MLX / C, 2 threads | max diff |"
    )
    print("|---|---|---|---|---|---|")
    assert native_attention.library() is not None, "no C compiler: nothing to compare"
    for name, rows, tokens, slotted in DECODE_LAYOUTS:
        capacity = (tokens // 256 + 2) * 256
        layer_calls = []
        for _ in range(layers):
            if slotted:  # the ShortSlots' layout: rows side by side, each attending a prefix
                k, v = (mx.random.normal((rows, 3, capacity, 64))[:, :, : tokens + 1] for _ in range(2))
                q = mx.random.normal((rows, 9, 1, 64))
                mx.eval(k, v, q)
                calls = [AttentionCall(q, k, v, prefix_lengths=(tokens + 1,) * rows)]
            else:
                calls = []
                for _ in range(rows):
                    k, v = (mx.random.normal((1, 3, capacity, 64))[:, :, :tokens] for _ in range(2))
                    q = mx.random.normal((1, 9, 1, 64))
                    mx.eval(k, v, q)
                    calls.append(AttentionCall(q, k, v))
            layer_calls.append(calls)

        def run(
            native: bool, threads: int, layer_calls: list[list[AttentionCall]] = layer_calls
        ) -> tuple[float, list[mx.array]]:
            shortcuts = replace(cpu_shortcuts(), native_attention=native, attention_threads=threads)
            times, last = [], []
            for _ in range(3):
                for calls in layer_calls:
                    started = time.perf_counter()
                    with in_ragged_step(shortcuts):
                        last = attend(calls, 0.125, None)
                    mx.eval(last)
                    times.append(time.perf_counter() - started)
            return ms(statistics.median(times)), last

        split_ms, want = run(False, 1)
        one_ms, _ = run(True, 1)
        two_ms, got = run(True, 2)
        difference = max(float(mx.abs(a - b).max()) for a, b in zip(got, want, strict=True))
        print(
            f"| {name} | {split_ms} | {one_ms} | {two_ms} | {split_ms / two_ms:.2f} | {difference:.1e} |",
            flush=True,
        )


def bench_split() -> None:
    import mlx.core as mx
    import numpy as np

    from engine.batch.attention import AttentionCall, attend
    from engine.cpu.shortcuts import cpu_shortcuts, in_ragged_step

    print("| shape | fused ms | numpy softmax ms | C ms | fused / numpy | numpy / C | max abs difference |")
    print("|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for name, batch, queries, keys, masked in SHAPES:
        q = mx.random.normal((batch, 9, queries, 64))
        k = mx.random.normal((batch, 3, keys, 64))
        v = mx.random.normal((batch, 3, keys, 64))
        mask: mx.array | str | None = "causal" if queries > 1 else None
        if masked:
            lengths = mx.array(rng.integers(keys // 2, keys + 1, batch))
            mask = (mx.arange(keys)[None, :] < lengths[:, None])[:, None, None, :]
        mx.eval(q, k, v)
        call = AttentionCall(q, k, v, mask)

        def fused(call: AttentionCall = call) -> mx.array:
            out = mx.fast.scaled_dot_product_attention(
                call.queries, call.keys, call.values, scale=0.125, mask=call.mask
            )
            mx.eval(out)
            return out

        def split(call: AttentionCall = call, native: bool = False) -> mx.array:
            with in_ragged_step(replace(cpu_shortcuts(), native_attention=native)):
                (out,) = attend([call], 0.125, None)
            mx.eval(out)
            return out

        def native(call: AttentionCall = call) -> mx.array:
            return split(call, native=True)

        difference = max(float(mx.abs(fused() - out).max()) for out in (split(), native()))
        fused_ms, split_ms, native_ms = median_ms(fused), median_ms(split), median_ms(native)
        print(
            f"| {name} | {fused_ms} | {split_ms} | {native_ms} | {fused_ms / split_ms:.2f} "
            f"| {split_ms / native_ms:.2f} | {difference:.1e} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
