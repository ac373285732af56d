"""What engine/batch/acceleration.py takes from this package: the step's shortcuts, the row
padding, the attention split, SwiGLU's routing and the start-time preparation, in one place."""

from __future__ import annotations

import logging

import mlx.core as mx

from engine.cpu import native_attention
from engine.cpu.blas import find_openblas, openblas_loaded
from engine.cpu.gemm_rows import padded_rows
from engine.cpu.numpy_exp import route_swiglu
from engine.cpu.quantized_attention import attend_quantized
from engine.cpu.shortcuts import CpuShortcuts, cpu_shortcuts, in_ragged_step
from engine.cpu.split_attention import attend

__all__ = [
    "CpuShortcuts",
    "attend",
    "attend_quantized",
    "in_ragged_step",
    "padded_rows",
    "prepare",
    "route_swiglu",
    "step_shortcuts",
]

log = logging.getLogger("kvrq.engine.cpu")


def step_shortcuts(tokens: int, scores: int) -> CpuShortcuts:
    return cpu_shortcuts().sized_for(tokens, scores)


def prepare() -> str:
    """Check the switches, build the C library where it is wanted, and say what runs: at start,
    so that neither a bad KVRQ_* value nor a compile ever lands inside a step."""
    shortcuts = cpu_shortcuts()
    if shortcuts.native_attention and native_attention.library() is None:
        shortcuts = CpuShortcuts(shortcuts.numpy_exp, shortcuts.pad_rows, False, shortcuts.attention_threads)
    if mx.default_device() == mx.cpu and find_openblas() and not openblas_loaded():
        log.warning("OpenBLAS is installed but not preloaded: matmuls run 10x slower (see README, fast path)")
    return f"CPU shortcuts: {shortcuts.describe()}"
