"""Build a Hugging Face fast tokenizer from GGUF metadata with `tokenizers` alone (no torch)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

SPECIAL_TOKEN_TYPE = 3


def tokenizer_from_gguf_metadata(meta: dict[str, Any]) -> Any:
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    raw_types: Any = meta["tokenizer.ggml.token_type"]
    as_list: Any = raw_types.tolist() if isinstance(raw_types, mx.array) else raw_types
    token_types: list[Any] = list(as_list)
    vocab = {token: index for index, token in enumerate(tokens)}

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    specials = [tokens[i] for i, kind in enumerate(token_types) if kind == SPECIAL_TOKEN_TYPE]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])

    def token_at(key: str) -> str:
        value: Any = meta[key]
        index: Any = value.item() if isinstance(value, mx.array) else value
        return tokens[int(index)]

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=token_at("tokenizer.ggml.bos_token_id"),
        eos_token=token_at("tokenizer.ggml.eos_token_id"),
        unk_token=token_at("tokenizer.ggml.unknown_token_id"),
        pad_token=token_at("tokenizer.ggml.padding_token_id"),
    )
    hf.chat_template = meta["tokenizer.chat_template"]
    return TokenizerWrapper(hf)
