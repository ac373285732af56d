"""How many rows a CPU step's matmuls should have: 16 for 10 to 16 rows, 32 for 20 to 31.

Why: every projection of a step is a (rows x hidden) @ (hidden x out) matmul, and OpenBLAS's
sgemm (what MLX calls on the CPU) is fastest at 16-row multiples: on the 2-core dev machine a
SmolLM2 MLP matmul (576 -> 1536) took 0.28 ms at 16 rows against 0.67 at 12, 0.40 at 8 and 0.22
at 1; the 49K-vocabulary head 15 ms at 16 rows against 29 at 12 (docs/platform.md). Whole
decode steps, padded against not in one engine (`python benchmarks/bench_engine.py --only rows`):
1.41x faster at 12 rows, 1.12x at 24-31, 1.01-1.05x at 4-8; but 0.86x at 2-3 rows and 0.92x at
17 in an earlier run (the padding's share is too large), so those run as they are, as do 1 row
and 32 or more (prefill chunks). On the VM of 2026-11-28 4-9 rows padded were 0.85-0.96x (10-12:
1.03-1.13x; 20-31: 0.88-1.08x), and 4 rows' throughput against raw mlx-lm 0.87 padded, 1.01 not:
4-9 rows run as they are too, where at best they gained 1-5%.

Guarantees: CPU only (Metal and CUDA keep their own kernels' shapes); the padding rows
write no K/V, take no position, reach no sampler; KVRQ_PAD_ROWS=0 turns it off
(engine/cpu/shortcuts.py).
"""

from __future__ import annotations

# (fewest rows, most rows, rows run): measured on SmolLM2's step, see the docstring.
PADDED_RANGES = ((10, 16, 16), (20, 31, 32))


def padded_rows(rows: int, on: bool = True) -> int:
    """The row count to run `rows` as (at least `rows`)."""
    if on:
        for low, high, run_as in PADDED_RANGES:
            if low <= rows <= high:
                return run_as
    return rows
