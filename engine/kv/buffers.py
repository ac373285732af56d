"""MLX KV buffers and their numpy views: what both the plain and the layered conversions build on.

Why its own module: engine/kv/convert.py (full attention) and engine/kv/layered.py (sliding
windows, SSM state) both allocate buffers of a spec's dtype and write them through numpy views;
the arena (engine/kv/arena.py) hands the same buffers out again. Keeping these here lets each
of those import it without importing one another.
"""

from __future__ import annotations

import contextlib
import os
import threading

import mlx.core as mx
import numpy as np

from engine.core.spec import ModelCacheSpec

MLX_DTYPE = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def mlx_dtype(spec: ModelCacheSpec) -> mx.Dtype:
    return MLX_DTYPE[spec.dtype]


def keep_buffers_resident(n_bytes: int) -> None:
    """Let MLX keep at least `n_bytes` of freed buffers for reuse (never lowers the limit)."""
    previous = mx.set_cache_limit(n_bytes)
    if previous > n_bytes:
        mx.set_cache_limit(previous)


def host_view(array: mx.array) -> np.ndarray:
    """Zero-copy numpy view of an evaluated MLX array (bfloat16 as its uint16 bits).

    Writable: writing through it changes the MLX array in place, which is only safe on a
    buffer no other MLX array shares. Drop the view after use: while it lives, MLX cannot
    update the buffer in place and copies it instead.
    """
    if array.dtype == mx.bfloat16:
        array = array.view(mx.uint16)
        mx.eval(array)
    return np.asarray(array)


def round_up(n_tokens: int, block_tokens: int) -> int:
    return -(-n_tokens // block_tokens) * block_tokens


def empty_layer_buffers(spec: ModelCacheSpec, capacity: int) -> list[tuple[mx.array, mx.array]]:
    """Fresh, exclusively owned (1, heads, capacity, dim) K and V buffers for every layer."""
    dtype = mlx_dtype(spec)
    buffers = [
        (
            mx.zeros((1, spec.n_kv_heads, capacity, spec.k_head_dim), dtype=dtype),
            mx.zeros((1, spec.n_kv_heads, capacity, spec.v_head_dim), dtype=dtype),
        )
        for _ in range(spec.n_layers)
    ]
    mx.eval(buffers)
    return buffers


BACKGROUND_NICE = 10


def yield_to_the_step() -> None:
    """Lower the calling thread's priority (Linux: a thread's own nice value), so work in the
    background (cutting finished caches, making buffers ahead) takes cores the model's step leaves
    idle, not its own."""
    with contextlib.suppress(AttributeError, OSError):  # no per-thread priority (macOS): run as is
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
