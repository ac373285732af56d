"""The ragged step's CPU-only shortcuts, decided once per step in one place.

Why: three shortcuts exist only for MLX's CPU device: exp from numpy (engine/cpu/numpy_exp.py),
matmuls run at OpenBLAS's fast row counts (engine/cpu/gemm_rows.py) and decoding rows' attention
in one C call a layer (engine/cpu/native_attention.py), with its thread count. They share the
device check, each has its own switch and KVRQ_CPU_SHORTCUTS=0 turns all of them off (the path
Metal and CUDA take, which CI runs a second time this way); deciding them together once a step
keeps a step's layers consistent and the device and environment lookups out of the per-layer path.

Guarantee: outside `in_ragged_step` (mlx-lm's own generation, the parity tests' reference)
every shortcut is off.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import mlx.core as mx

from engine.core.switches import count, switch

MASTER_SWITCH = "KVRQ_CPU_SHORTCUTS"


@dataclass(frozen=True)
class CpuShortcuts:
    numpy_exp: bool  # softmax and SwiGLU exp outside MLX; KVRQ_NUMPY_EXP=0 turns it off
    pad_rows: bool  # flat batches padded to 16/32 rows; KVRQ_PAD_ROWS=0 turns it off
    native_attention: bool  # attention's C loops; KVRQ_NATIVE_ATTENTION=0 turns them off
    attention_threads: int = 0  # the C loops' threads, KVRQ_ATTENTION_THREADS; 0: as the work pays

    def sized_for(self, tokens: int, scores: int) -> CpuShortcuts:
        """These shortcuts for a step of `tokens` query tokens (before padding) with `scores`
        attention scores a head and layer: a step of up to seven short rows keeps MLX's fused
        calls, whose lack of a sync per layer is worth more there than numpy's and C's speed
        (1 row over 100 keys: steps 0.91x as long; over 1200 keys: even; 4 short rows decoding
        with the shortcuts: 0.76x raw mlx-lm's throughput, the syncs' cost, issue 43)."""
        if tokens < SMALL_STEP_TOKENS and scores < SMALL_STEP_SCORES:
            return self.fused()
        return self

    def fused(self) -> CpuShortcuts:
        """These shortcuts without the split (numpy's exp, the C attention): MLX's fused calls."""
        return replace(self, numpy_exp=False, native_attention=False)

    def describe(self) -> str:
        on = [name for name in ("numpy_exp", "pad_rows", "native_attention") if getattr(self, name)]
        return ", ".join(on) if on else "none"


# A step below both is small (measured on the 2-core dev machine, SmolLM2).
SMALL_STEP_TOKENS = 8
SMALL_STEP_SCORES = 1024
OFF = CpuShortcuts(numpy_exp=False, pad_rows=False, native_attention=False)
_step = threading.local()


def cpu_shortcuts() -> CpuShortcuts:
    """The shortcuts the environment and the device allow (all off on Metal and CUDA)."""
    if mx.default_device() != mx.cpu or not switch(MASTER_SWITCH):
        return OFF
    return CpuShortcuts(
        numpy_exp=switch("KVRQ_NUMPY_EXP"),
        pad_rows=switch("KVRQ_PAD_ROWS"),
        native_attention=switch("KVRQ_NATIVE_ATTENTION"),
        attention_threads=count("KVRQ_ATTENTION_THREADS"),
    )


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
