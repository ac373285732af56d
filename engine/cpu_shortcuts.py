"""The ragged step's CPU-only shortcuts, decided once per step in one place.

Why: three shortcuts exist only for MLX's CPU device: exp from numpy (engine/numpy_exp.py),
matmuls run at OpenBLAS's fast row counts (engine/gemm_rows.py) and decoding rows' attention in
one C call a layer (engine/native_attention.py), with its thread count. They share the device
check, each has its own opt-out; deciding them together once a step keeps a step's layers
consistent and the device and environment lookups out of the per-layer path.

Guarantee: outside `in_ragged_step` (mlx-lm's own generation, the parity tests' reference)
every shortcut is off.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import mlx.core as mx


@dataclass(frozen=True)
class CpuShortcuts:
    numpy_exp: bool  # softmax and SwiGLU exp from numpy; KVRQ_NUMPY_EXP=0 turns it off
    pad_rows: bool  # flat batches padded to 16/32 rows; KVRQ_PAD_ROWS=0 turns it off
    native_attention: bool  # decoding rows' attention in C; KVRQ_NATIVE_ATTENTION=0 turns it off
    attention_threads: int = 0  # the C loops' threads, KVRQ_ATTENTION_THREADS; 0: as the work pays

    def sized_for(self, tokens: int, scores: int) -> CpuShortcuts:
        """These shortcuts for a step of `tokens` query tokens (before padding) with `scores`
        attention scores a head and layer: a step of one or two short rows keeps MLX's fused
        calls, whose lack of a sync per layer is worth more there than numpy's and C's speed
        (1 row over 100 keys: steps 0.91x as long; over 1200 keys or 4 rows: even)."""
        if tokens < SMALL_STEP_TOKENS and scores < SMALL_STEP_SCORES:
            return replace(self, numpy_exp=False, native_attention=False)
        return self


# A step below both is small (measured on the 2-core dev machine, SmolLM2).
SMALL_STEP_TOKENS = 4
SMALL_STEP_SCORES = 1024
OFF = CpuShortcuts(numpy_exp=False, pad_rows=False, native_attention=False)
_step = threading.local()


def cpu_shortcuts() -> CpuShortcuts:
    on_cpu = mx.default_device() == mx.cpu
    return CpuShortcuts(
        numpy_exp=on_cpu and _enabled("KVRQ_NUMPY_EXP"),
        pad_rows=on_cpu and _enabled("KVRQ_PAD_ROWS"),
        native_attention=on_cpu and _enabled("KVRQ_NATIVE_ATTENTION"),
        attention_threads=_count("KVRQ_ATTENTION_THREADS"),
    )


def _enabled(variable: str) -> bool:
    return os.environ.get(variable, "1") != "0"


def _count(variable: str) -> int:
    configured = os.environ.get(variable, "")
    return int(configured) if configured.isdigit() else 0


def current() -> CpuShortcuts:
    """The shortcuts of the ragged step being built on this thread (OFF outside one): read by
    every layer's attention and SwiGLU."""
    shortcuts: CpuShortcuts = getattr(_step, "shortcuts", OFF)
    return shortcuts


@contextmanager
def in_ragged_step(shortcuts: CpuShortcuts) -> Iterator[None]:
    """While the ragged step builds its forward pass: the routed functions use `shortcuts`."""
    _step.shortcuts = shortcuts
    try:
        yield
    finally:
        _step.shortcuts = OFF
