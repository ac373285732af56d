"""Tiny randomly initialised models built from mlx-lm's own model classes, and a byte-level tokenizer
(the engine's tests import them through tests/engine/tiny.py; bench_kv_quant.py measures two of them).

One config per family the engine is tested on (tests/engine/test_families.py): every config
is as small as the architecture allows (hidden 64, 2 to 6 layers, vocabulary 256) while
keeping what makes the family different: sliding-window layers (gemma3_text, ministral3,
gpt_oss), MLA with different K and V dims (deepseek_v2/v3), per-layer head counts (openelm),
linear attention or SSM layers (qwen3_next, qwen3_5, falcon_h1, mamba, mamba2), experts
(qwen3_moe, mixtral).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": 256,
}

_DEEPSEEK: dict[str, Any] = {
    **COMMON,
    "num_key_value_heads": 4,
    "moe_intermediate_size": 32,
    "n_shared_experts": 1,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "kv_lora_rank": 32,
    "q_lora_rank": 48,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 1024,
}

_LINEAR_ATTENTION: dict[str, Any] = {
    "num_hidden_layers": 4,
    "full_attention_interval": 2,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "head_dim": 16,
    "max_position_embeddings": 1024,
}

CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {**COMMON, "max_position_embeddings": 1024},
    "mistral": {**COMMON, "max_position_embeddings": 1024},  # mlx-lm runs it as llama
    "qwen2": {**COMMON, "max_position_embeddings": 1024},
    "qwen3": {
        **COMMON,
        "max_position_embeddings": 1024,
        "head_dim": 16,
        "tie_word_embeddings": True,
        "rope_theta": 10000.0,
    },
    "qwen3_moe": {
        **COMMON,
        "max_position_embeddings": 1024,
        "head_dim": 16,
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
    },
    "mixtral": {**COMMON, "num_local_experts": 4, "num_experts_per_tok": 2},
    "phi3": {**COMMON, "max_position_embeddings": 1024, "original_max_position_embeddings": 1024},
    "gemma3_text": {
        **COMMON,
        "num_hidden_layers": 6,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "sliding_window": 32,
        "sliding_window_pattern": 3,
    },
    "ministral3": {
        **COMMON,
        "num_hidden_layers": 4,
        "head_dim": 16,
        "max_position_embeddings": 1024,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "sliding_window": 32,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "llama_4_scaling_beta": 0.1,
            "original_max_position_embeddings": 1024,
        },
    },
    "gpt_oss": {
        **COMMON,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "head_dim": 16,
        "sliding_window": 32,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "deepseek_v2": {
        **_DEEPSEEK,
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
        "rope_scaling": {"type": "yarn", "factor": 1.0, "original_max_position_embeddings": 1024},
    },
    "deepseek_v3": _DEEPSEEK,
    "qwen3_next": {
        **COMMON,
        **_LINEAR_ATTENTION,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 32,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
    },
    "qwen3_5": {
        "text_config": {
            **COMMON,
            **_LINEAR_ATTENTION,
            "model_type": "qwen3_5",
            "rope_parameters": {
                "type": "default",
                "mrope_section": [2, 1, 1],
                "rope_theta": 10000,
                "partial_rotary_factor": 0.5,
            },
        }
    },
    "falcon_h1": {
        **COMMON,
        "head_dim": 16,
        "mamba_d_conv": 4,
        "mamba_d_head": 16,
        "mamba_d_ssm": 64,
        "mamba_d_state": 16,
        "mamba_n_groups": 1,
        "mamba_n_heads": 4,
        "mamba_chunk_size": 16,
        "mlp_expansion_factor": 2,
        "max_position_embeddings": 1024,
    },
    "openelm": {  # per-layer head counts: layer 0 keeps 1 KV head, layer 1 keeps 2
        "head_dim": 16,
        "num_transformer_layers": 2,
        "model_dim": 64,
        "vocab_size": 256,
        "ffn_dim_divisor": 8,
        "num_query_heads": [2, 4],
        "num_kv_heads": [1, 2],
        "ffn_multipliers": [1.0, 2.0],
    },
    "llama4": {  # chunked attention (ChunkedKVCache), which mlx-lm cannot batch
        "text_config": {
            **COMMON,
            "model_type": "llama4_text",
            "num_hidden_layers": 4,
            "head_dim": 16,
            "attention_bias": False,
            "attention_chunk_size": 64,
            "interleave_moe_layer_step": 1,
            "intermediate_size_mlp": 128,
            "max_position_embeddings": 1024,
            "num_experts_per_tok": 1,
            "num_local_experts": 2,
            "rope_scaling": None,
            "rope_theta": 10000.0,
            "use_qk_norm": True,
        }
    },
    "mamba": {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "state_size": 16,
        "num_hidden_layers": 2,
        "conv_kernel": 4,
        "use_bias": False,
        "use_conv_bias": True,
        "time_step_rank": 8,
    },
    "mamba2": {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 4,
        "head_dim": 32,
        "state_size": 16,
        "n_groups": 1,
        "num_hidden_layers": 2,
        "layer_norm_epsilon": 1e-5,
        "conv_kernel": 4,
        "use_bias": False,
        "use_conv_bias": True,
        "tie_word_embeddings": True,
        "time_step_limit": [0.0, float("inf")],
        "time_step_rank": 8,
        "chunk_size": 16,
    },
}


# Overrides that make every KV head dim a multiple of 32, so q8/q4 at rest (group size 32) applies.
QUANTIZABLE: dict[str, dict[str, Any]] = {
    **{arch: {"num_attention_heads": 2, "num_key_value_heads": 1} for arch in ("llama", "mistral", "qwen2")},
    **{arch: {"num_attention_heads": 2, "num_key_value_heads": 1} for arch in ("phi3", "mixtral")},
    **{arch: {"head_dim": 32} for arch in ("qwen3", "qwen3_moe", "ministral3", "gpt_oss", "falcon_h1")},
    "gemma3_text": {"head_dim": 32, "query_pre_attn_scalar": 32},
    "deepseek_v2": {"qk_nope_head_dim": 24, "qk_rope_head_dim": 8, "v_head_dim": 32},
    "deepseek_v3": {"qk_rope_head_dim": 32},
    "qwen3_next": {"head_dim": 32},
    "qwen3_5": {"text_config": {**CONFIGS["qwen3_5"]["text_config"], "head_dim": 32}},
    "openelm": {"head_dim": 32},
    "mamba": {},
    "mamba2": {},
}


# MLX's CUDA rope with per-row offsets (what a ragged batch hands it) fails from 128 rows on when
# the rotated dims are 8 or 16 (`cudaGraphAddKernelNode ... invalid argument`; mlx 0.32.0 and 0.32.4
# on an H200, benchmarks/README.md "GPU check"); real models rotate 64 or more. On CUDA the tiny
# models take head dims of 32, which it handles: the parity they test is the same.
CUDA_ROPE_DIMS: dict[str, dict[str, Any]] = {
    **QUANTIZABLE,
    "deepseek_v2": {"qk_nope_head_dim": 16, "qk_rope_head_dim": 32, "v_head_dim": 32},
}


def model_config(arch: str, **overrides: Any) -> dict[str, Any]:
    """The config.json an mlx-lm folder of this tiny model would hold."""
    on_cuda = CUDA_ROPE_DIMS.get(arch, {}) if mx.cuda.is_available() else {}
    return {"model_type": arch, **CONFIGS[arch], **on_cuda, **overrides}


def tiny_model(arch: str, seed: int = 0, **overrides: Any) -> Any:
    from mlx_lm.utils import _get_classes  # mlx-lm's own model_type -> classes mapping (remaps mistral)

    config = model_config(arch, **overrides)
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    mx.eval(model.parameters())
    return model


def save_model_folder(model: Any, config: dict[str, Any], folder: Path) -> None:
    """Write config.json and model.safetensors as an mlx-lm model folder (the tokenizer is the caller's)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})


class ByteTokenizer:
    """Token i is byte i; token 0 doubles as EOS. Decoding invalid UTF-8 yields U+FFFD like real BPE."""

    eos_token_ids = frozenset({0})

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, tokens: list[int]) -> str:
        return bytes(t for t in tokens if t).decode(errors="replace")
