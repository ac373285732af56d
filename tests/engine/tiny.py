"""Tiny randomly initialised models and a byte-level tokenizer, for fast engine tests."""

from __future__ import annotations

import importlib
from typing import Any

import mlx.core as mx

COMMON = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": 256,
}

CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {**COMMON, "max_position_embeddings": 1024},
    "qwen2": {**COMMON, "max_position_embeddings": 1024},
    "qwen3": {
        **COMMON,
        "max_position_embeddings": 1024,
        "head_dim": 16,
        "tie_word_embeddings": True,
        "rope_theta": 10000.0,
    },
    "gemma3_text": {
        **COMMON,
        "num_hidden_layers": 6,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "sliding_window": 32,
        "sliding_window_pattern": 3,
    },
    "mixtral": {**COMMON, "num_local_experts": 4, "num_experts_per_tok": 2},
}


def tiny_model(arch: str, seed: int = 0, **overrides: Any) -> Any:
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs(model_type=arch, **{**CONFIGS[arch], **overrides}))
    mx.eval(model.parameters())
    return model


class ByteTokenizer:
    """Token i is byte i; token 0 doubles as EOS. Decoding invalid UTF-8 yields U+FFFD like real BPE."""

    eos_token_ids = frozenset({0})

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, tokens: list[int]) -> str:
        return bytes(t for t in tokens if t).decode(errors="replace")
