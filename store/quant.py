"""KV quantization at rest: the rule lives in engine/kv/quant.py (the pool quantizes with the
same one, so blocks move between pool and store as they are); re-exported here for the store."""

from __future__ import annotations

from engine.kv.quant import (
    GROUP_SIZES,
    QUANT_BITS,
    Quantization,
    check_quantization,
    dequantize,
    quantize,
)

__all__ = ["GROUP_SIZES", "QUANT_BITS", "Quantization", "check_quantization", "dequantize", "quantize"]
