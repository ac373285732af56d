"""The batching loop's one door to the CPU acceleration (engine/cpu).

Why a door: the ragged step runs the same on every device, and only on MLX's CPU does it take
shortcuts (exp outside MLX, padded rows, attention in C). Everything the step needs of them
passes through the few functions here; where engine/cpu is not there (deleted, or left out of a
build) each falls back to MLX's own ops, so the engine still runs, as it does on Metal and CUDA
(and with KVRQ_CPU_SHORTCUTS=0).
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import mlx.core as mx

from engine.batch.attention import AttentionCall, QuantizedCall, fused_attention, quantized_attention
from engine.core.cpu_package import cpu_module

log = logging.getLogger("kvrq.engine")

#: A step's shortcuts as the CPU package decided them; opaque here (None without the package).
StepShortcuts = Any


_door = cpu_module("door")


_logged: set[str] = set()


def prepare() -> str:
    """Decide and build what the CPU path needs and log it (once per process and choice): called
    when a batch generator is made, so that no step ever compiles or rejects a KVRQ_* value."""
    choice = str("CPU shortcuts: none (engine/cpu is not installed)" if _door is None else _door.prepare())
    if choice not in _logged:
        _logged.add(choice)
        log.info("%s", choice)
    return choice


def step_shortcuts(tokens: int, scores: int) -> StepShortcuts:
    """The shortcuts of a step of `tokens` query tokens with `scores` scores a head and layer."""
    return None if _door is None else _door.step_shortcuts(tokens, scores)


def fused(shortcuts: StepShortcuts) -> StepShortcuts:
    """`shortcuts` without the split (a sync per layer): MLX's fused calls, the padding kept."""
    return None if shortcuts is None else shortcuts.fused()


def padded_rows(rows: int, shortcuts: StepShortcuts) -> int:
    """The row count a step of `rows` rows runs as (at least `rows`)."""
    return rows if _door is None else int(_door.padded_rows(rows, shortcuts.pad_rows))


def step_rows(tokens: int) -> int:
    """The rows a step of `tokens` query tokens runs as: what its cost follows (Speculation's StepTimes)."""
    return padded_rows(tokens, step_shortcuts(tokens, 0))


def in_step(shortcuts: StepShortcuts) -> AbstractContextManager[None]:
    """While the step's forward pass is built: the routed functions use `shortcuts`."""
    if _door is None:
        return nullcontext()
    context: AbstractContextManager[None] = _door.in_ragged_step(shortcuts)
    return context


def attend(calls: list[AttentionCall], scale: float, sinks: mx.array | None) -> list[mx.array]:
    """Each call's attention output, in order: the CPU path's where it takes the calls, else MLX's."""
    taken = None if _door is None else _door.attend(calls, scale, sinks)
    return fused_attention(calls, scale, sinks) if taken is None else list(taken)


def attend_quantized(calls: list[QuantizedCall], scale: float, sinks: mx.array | None) -> list[mx.array]:
    """The same for rows whose K/V are quantized: the CPU path's C loop where it takes them."""
    taken = None if _door is None else _door.attend_quantized(calls, scale, sinks)
    return quantized_attention(calls, scale, sinks) if taken is None else list(taken)


def route_swiglu(module: Any) -> None:
    """Let the step's shortcuts reach `module`'s SwiGLU (nothing without the CPU package)."""
    if _door is not None:
        _door.route_swiglu(module)
