"""Attention on the CPU: MLX's fused call vs kvrq's split with numpy's softmax, same inputs, same run.

The shapes are the ragged step's: a warm agent's 17 suffix tokens over its history, a 256-token
prefill chunk, one decoding row over a long history, 16 slotted short rows. Prints a markdown
table of medians (ms) and the ratio fused / numpy (above 1: the numpy softmax is faster).
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_engine import ms, timed  # noqa: E402

from engine.fastpath import ensure_fast_blas  # noqa: E402

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
    ensure_fast_blas()
    import mlx.core as mx
    import numpy as np

    from engine.attention import AttentionCall, attend
    from engine.cpu_shortcuts import cpu_shortcuts, in_ragged_step

    print("| shape | fused ms | numpy softmax ms | fused / numpy | max abs difference |")
    print("|---|---|---|---|---|")
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

        def split(call: AttentionCall = call) -> mx.array:
            with in_ragged_step(replace(cpu_shortcuts(), native_attention=False)):  # the split path
                (out,) = attend([call], 0.125, None)
            mx.eval(out)
            return out

        difference = float(mx.abs(fused() - split()).max())
        fused_ms, split_ms = median_ms(fused), median_ms(split)
        ratio = fused_ms / split_ms
        print(f"| {name} | {fused_ms} | {split_ms} | {ratio:.2f} | {difference:.1e} |", flush=True)


if __name__ == "__main__":
    main()
