"""load_model: any mlx-lm model id or path, or the builtin offline SmolLM2-135M."""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import mlx.nn as nn

BUILTIN_MODEL = "smollm2-135m"

log = logging.getLogger(__name__)


def on_cpu() -> bool:
    return bool(mx.default_device() == mx.cpu)


def load_model(name: str = BUILTIN_MODEL, *, dequantize: bool | None = None) -> tuple[nn.Module, Any]:
    """Return (model, tokenizer wrapper).

    `dequantize=None` picks the fast path for the device: on the CPU quantized
    matmuls are slow and do not batch, so weights become float32 there; on Metal or
    CUDA they stay quantized.
    """
    if dequantize is None:
        dequantize = on_cpu()
    if name == BUILTIN_MODEL:
        from engine.gguf_smollm2 import load_smollm2

        model, tokenizer = load_smollm2(dequantize=dequantize)
    else:
        from mlx_lm import load

        model, tokenizer = load(name)[:2]
        if dequantize and _is_quantized(model):
            from mlx_lm.utils import dequantize_model

            model = dequantize_model(model)
    _warn_if_slow_blas()
    return model, tokenizer


def _is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding) for _, m in model.named_modules())


def _warn_if_slow_blas() -> None:
    from engine.fastpath import find_openblas, openblas_loaded

    if on_cpu() and find_openblas() and not openblas_loaded():
        log.warning("OpenBLAS is installed but not preloaded: matmuls run 10x slower (see README, fast path)")
