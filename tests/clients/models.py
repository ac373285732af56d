"""Test models for agent CLIs, written at test time (no download): a tiny llama with the builtin
SmolLM2 tokenizer and the context asked for, whose weights make it answer `OK` and end its turn.

A CLI picks its own answer length (Claude Code and opencode ask for 32,000 tokens, which the builtin
would spend minutes on), and Claude Code's default request (about 21K SmolLM2 tokens) and Codex's
(9K) outgrow the builtin's 8K context: 32K for those two; 8K, the builtin's, for opencode's overflow
case. Attention and MLP run (their K/V are what the store saves and resumes) but add nothing to the
residual stream, so the next token depends on the current one only: any token -> `OK` -> end of
turn. The protocol is what the tests check, not answers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx

from tests.engine.tiny import model_config, save_model_folder, tiny_model

VOCAB = 49152  # the builtin tokenizer's
LONG_CONTEXT = 32768
ANSWER = "OK"


def write_ok_model(folder: Path, context: int = LONG_CONTEXT) -> Path:
    """Write the model folder (config, weights, tokenizer) and return it."""
    from engine.models.gguf_smollm2 import gguf_path
    from engine.models.gguf_tokenizer import tokenizer_from_gguf_metadata

    loaded: Any = mx.load(str(gguf_path()), return_metadata=True)
    tokenizer = tokenizer_from_gguf_metadata(loaded[1])
    tokenizer._tokenizer.save_pretrained(str(folder))
    (answer,) = tokenizer.encode(ANSWER)
    (end,) = sorted(tokenizer.eos_token_ids)
    overrides = {"vocab_size": VOCAB, "max_position_embeddings": context, "tie_word_embeddings": False}
    model = tiny_model("llama", **overrides)
    _answer_then_stop(model, answer, end)
    save_model_folder(model, model_config("llama", **overrides), folder)
    return folder


def _answer_then_stop(model: Any, answer: int, end: int) -> None:
    """Dimension 0 of every embedding is 1 (a bias), dimension 1 marks the answer token; the head
    scores `answer` high from the bias and `end` high from the mark. Layers keep their random K/V
    projections but their outputs are zeroed, so the residual stream is the embedding."""
    embed = model.model.embed_tokens.weight
    hidden = embed.shape[1]
    noise = mx.random.normal(embed.shape) * 0.01
    mark = mx.zeros((embed.shape[0],)).at[answer].add(1.0)
    embedding = mx.concatenate([mx.ones((embed.shape[0], 1)), mark[:, None], noise[:, 2:]], axis=1)
    head = mx.zeros((embed.shape[0], hidden))
    head = head.at[answer, 0].add(10.0).at[answer, 1].add(-20.0).at[end, 1].add(30.0)
    model.model.embed_tokens.weight = embedding
    model.lm_head.weight = head
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
        layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    mx.eval(model.parameters())
