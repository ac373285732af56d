"""Test models for agent CLIs, written at test time (no download): tiny llamas with the builtin
SmolLM2 tokenizer and the context asked for.

A CLI picks its own answer length (Claude Code and opencode ask for 32,000 tokens, which the builtin
would spend minutes on), and Claude Code's default request (about 21K SmolLM2 tokens) and Codex's
(9K) outgrow the builtin's 8K context: 32K for those two; 8K, the builtin's, for opencode's overflow
case. The protocol is what the tests check, not answers.

- The `OK` model (`write_ok_model`): attention and MLP run (their K/V are what the store saves and
  resumes) but add nothing to the residual stream, so the next token depends on the current one
  only: any token -> `OK` -> end of turn.
- The tool-call model (`write_tool_call_model`): answers with one given tool call while the prompt
  holds no earlier call of it, and `Done` once it does (the turn after the tool's result came back).
  The call is a chain of tokens (each token's embedding names it, the head scores its successor);
  one attention head, made blind to position, tells whether the call's marker token (a word only the
  call holds) is anywhere in the context: that switches the answer's first token to `Done`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx

from tests.engine.tiny import model_config, save_model_folder, tiny_model

VOCAB = 49152  # the builtin tokenizer's
LONG_CONTEXT = 32768
ANSWER = "OK"
FINAL = "Done"
#: The tool-call model's marker: a word no CLI's first request holds (one builtin token with its space).
MARKER = " giraffe"


def write_ok_model(folder: Path, context: int = LONG_CONTEXT) -> Path:
    """Write the model folder (config, weights, tokenizer) and return it."""
    tokenizer = _builtin_tokenizer(folder)
    (answer,) = tokenizer.encode(ANSWER)
    (end,) = sorted(tokenizer.eos_token_ids)
    overrides = _overrides(context)
    model = tiny_model("llama", **overrides)
    _answer_then_stop(model, answer, end)
    save_model_folder(model, model_config("llama", **overrides), folder)
    return folder


def _builtin_tokenizer(folder: Path) -> Any:
    """The builtin SmolLM2 tokenizer, also saved into `folder` (the model folder's tokenizer)."""
    from engine.models.gguf_smollm2 import gguf_path
    from engine.models.gguf_tokenizer import tokenizer_from_gguf_metadata

    loaded: Any = mx.load(str(gguf_path()), return_metadata=True)
    tokenizer = tokenizer_from_gguf_metadata(loaded[1])
    tokenizer._tokenizer.save_pretrained(str(folder))
    return tokenizer


def _overrides(context: int, **more: Any) -> dict[str, Any]:
    return {"vocab_size": VOCAB, "max_position_embeddings": context, "tie_word_embeddings": False, **more}


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
    _silence(model)
    mx.eval(model.parameters())


def _silence(model: Any) -> None:
    """Zero every layer's attention and MLP output: the residual stream stays the embedding."""
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
        layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """A call as the tool-call model writes it: the `<tool_call>` format kvrq parses for the builtin
    template, its end marker left out (a call the output ends in is parsed as is), spaced so that no
    token repeats (the chain's successors would clash), `arguments` first so that a token of the
    name may repeat one before the marker (exec_command's `_`, after tool_call's)."""
    return f'<tool_call>{{"arguments": {json.dumps(arguments, separators=(",", ":"))}, "name":"{name}"}}'


def write_tool_call_model(folder: Path, call: str, context: int = LONG_CONTEXT) -> Path:
    """Write the folder of a model that answers `call` (it must hold MARKER), then `Done` once the
    context holds MARKER; return the folder."""
    tokenizer = _builtin_tokenizer(folder)
    (end,) = sorted(tokenizer.eos_token_ids)
    (final,) = tokenizer.encode(FINAL)
    (marker,) = tokenizer.encode(MARKER)
    overrides = _overrides(context, rope_theta=1e12)
    model = tiny_model("llama", **overrides)
    _call_then_final(model, tokenizer.encode(call), marker, final, end)
    save_model_folder(model, model_config("llama", **overrides), folder)
    return folder


#: Residual dimensions of the tool-call model: the bias, the marker seen, the marker; then one per
#: token of the chain.
_BIAS, _SEEN, _MARK, _FIRST_CHAIN = 0, 1, 2, 3
#: A logit unit: margins are 1 to 3 of it, on a residual normalised to about 5.
_A = 10.0


def _call_then_final(model: Any, call: list[int], marker: int, final: int, end: int) -> None:
    """The weights (module docstring). Each token of the call but the marker may occur once before
    the marker and once after it: its successor after the marker wins once `seen` is on."""
    assert call.count(marker) == 1, "the call must hold the marker once"
    split = call.index(marker)
    for part in (call[:split], call[split + 1 :]):
        assert len(set(part)) == len(part) and final not in part, "a token repeats: respace the call"
    vocab, hidden = model.model.embed_tokens.weight.shape
    chain = sorted(set(call) | {final})
    assert _FIRST_CHAIN + len(chain) <= hidden, "the call has more tokens than the model has dimensions"
    dim = {token: _FIRST_CHAIN + i for i, token in enumerate(chain)}
    model.model.embed_tokens.weight = _chain_embedding(vocab, hidden, dim, marker)
    model.lm_head.weight = _chain_head(vocab, hidden, dim, call, split, final, end)
    _silence(model)
    _marker_detector(model.model.layers[0].self_attn)
    mx.eval(model.parameters())


def _chain_embedding(vocab: int, hidden: int, dim: dict[int, int], marker: int) -> mx.array:
    """The bias for every token, its own dimension for a chain token, the marker's mark; the other
    dimensions small noise (the other heads' random K/V differ per token)."""
    used = mx.array([_BIAS, _SEEN, _MARK, *dim.values()])
    embedding = (mx.random.normal((vocab, hidden)) * 0.01).at[:, used].multiply(0.0)
    embedding = embedding.at[:, _BIAS].add(1.0).at[marker, _MARK].add(1.0)
    for token, d in dim.items():
        embedding = embedding.at[token, d].add(1.0)
    return embedding


def _chain_head(
    vocab: int, hidden: int, dim: dict[int, int], call: list[int], split: int, final: int, end: int
) -> mx.array:
    """Logits, in units of _A: a chain token's successor 3 (a repeat's second successor 2, its first
    -2 more once seen); the call's first token 1 from the bias, -2 when seen or from a chain token
    (the prompt's last token is none); `Done` 2 when seen, -5 from a chain token; end of turn 3
    after the call's last token and after `Done`."""
    head = mx.zeros((vocab, hidden))
    first = call[0]
    head = head.at[first, _BIAS].add(_A).at[first, _SEEN].add(-2 * _A).at[final, _SEEN].add(2 * _A)
    for d in dim.values():
        head = head.at[first, d].add(-2 * _A).at[final, d].add(-5 * _A)
    before, after = call[:split], call[split + 1 :]
    for i, (token, successor) in enumerate(zip(call, [*call[1:], end], strict=True)):
        if i > split and token in before:  # the repeat: second best until seen
            head = head.at[successor, dim[token]].add(2 * _A)
        else:
            head = head.at[successor, dim[token]].add(3 * _A)
            if i < split and token in after:
                head = head.at[successor, _SEEN].add(-2 * _A)
    return head.at[end, dim[final]].add(3 * _A)


def _marker_detector(attention: Any) -> None:
    """Head 0 scores the marker's key far above every other (its query is the bias, its key the
    marker dimension, on the RoPE pair that rotates least: rope_theta 1e12 leaves it still over 32K
    positions) and carries only the marker's value into `seen`: 1 where the marker is in context, 0
    where it is not (no other token has a value)."""
    head_dim = attention.q_proj.weight.shape[0] // attention.n_heads
    still = head_dim // 2 - 1  # the last frequency of the first half: its pair turns least
    # the marker's embedding has 3 entries of 1 (bias, marker, its chain dimension): RMS-normed, each
    # is sqrt(hidden / 3); its value is scaled back to 1, the residual's unit
    unit = (3 / attention.q_proj.weight.shape[1]) ** 0.5
    rows = slice(0, head_dim)  # query head 0, and KV head 0 that it reads
    q = attention.q_proj.weight.at[rows].multiply(0.0).at[still, _BIAS].add(3.0)
    k = attention.k_proj.weight.at[rows].multiply(0.0).at[still, _MARK].add(3.0)
    v = attention.v_proj.weight.at[rows].multiply(0.0).at[0, _MARK].add(unit)
    o = attention.o_proj.weight.at[_SEEN, 0].add(1.0)
    attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight = q, k, v
    attention.o_proj.weight = o
