"""The ragged step's CPU-only shortcuts, decided once per step in one place.

Why: two shortcuts exist only for MLX's CPU device: exp from numpy (engine/numpy_exp.py) and
matmuls run at OpenBLAS's fast row counts (engine/gemm_rows.py). Both depend on the same
device check, each has its own opt-out; reading them together once a step keeps the step's
layers consistent and the device and environment lookups out of the per-layer path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class CpuShortcuts:
    numpy_exp: bool  # softmax and SwiGLU exp from numpy; KVRQ_NUMPY_EXP=0 turns it off
    pad_rows: bool  # flat batches padded to 16/32 rows; KVRQ_PAD_ROWS=0 turns it off


def cpu_shortcuts() -> CpuShortcuts:
    on_cpu = mx.default_device() == mx.cpu
    return CpuShortcuts(
        numpy_exp=on_cpu and os.environ.get("KVRQ_NUMPY_EXP", "1") != "0",
        pad_rows=on_cpu and os.environ.get("KVRQ_PAD_ROWS", "1") != "0",
    )
