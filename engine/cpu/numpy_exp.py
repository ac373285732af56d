"""Where kvrq's ragged step takes exp from numpy instead of MLX, on the CPU.

Why: MLX's CPU `exp` is scalar, 15-23 ns per float32 element against numpy's 1-3 ns
(docs/platform.md), and two parts of a transformer step are mostly exp: the softmax of
attention (engine/batch/attention.py) and the SiLU of a SwiGLU MLP. SiLU over a 256-token chunk's
256 x 1536 gate took 7.5 ms a layer in mlx-lm's compiled `swiglu` and 0.8 ms in numpy: a
quarter of a prefill step of SmolLM2.

Guarantees: only the ragged step's forward is affected (`in_ragged_step` in
engine/cpu/shortcuts.py), so mlx-lm's own generation (the parity tests' reference, mlx-lm's
BatchGenerator path) runs unchanged; results equal MLX's up to float32 rounding; only float32
on the CPU device; KVRQ_NUMPY_EXP=0 turns both parts off (engine/cpu/shortcuts.py).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from engine.cpu.shortcuts import current


def route_swiglu(module: Any) -> None:
    """Make `module.swiglu` (mlx-lm's llama, qwen2, qwen3 MLPs) use numpy inside the ragged step."""
    original = getattr(module, "swiglu", None)
    if original is None or getattr(original, "_kvrq_routed", False):
        return

    def swiglu(gate: mx.array, x: mx.array) -> mx.array:
        if not current().numpy_exp or gate.dtype != mx.float32 or x.dtype != mx.float32:
            return original(gate, x)
        return numpy_swiglu(gate, x)

    swiglu._kvrq_routed = True  # type: ignore[attr-defined]
    module.swiglu = swiglu


def numpy_swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """silu(gate) * x = gate / (1 + exp(-gate)) * x, evaluated now (one more sync per layer)."""
    mx.eval(gate, x)
    g = np.asarray(gate)
    out = np.negative(g)
    with np.errstate(over="ignore"):  # exp(-gate) -> inf for gate < -88: silu -> -0, as in MLX
        np.exp(out, out=out)
    out += 1
    np.divide(g, out, out=out)
    out *= np.asarray(x)
    return mx.array(out)
