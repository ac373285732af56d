"""Per-request samplers and logits processors, built from mlx-lm's own (mlx_lm.sample_utils), so a row
of the batch samples exactly as mlx-lm does for a single sequence. Each seeded request owns its random
key, so its tokens do not depend on which other requests share the batch."""

from __future__ import annotations

import os
from collections.abc import Callable

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from engine.core.params import LogitsProcessor, SamplingParams
from engine.core.results import TokenLogprobs

Sampler = Callable[[mx.array], mx.array]


def make_sampler(params: SamplingParams) -> Sampler | None:
    """None means greedy: the batch's shared argmax, one call for the whole batch.

    The filters run in mlx-lm's order (top_p, min_p, top_k) and the draw is mlx-lm's categorical over
    logprobs / temperature, with one key split per token as mx.random's own key sequence does: a row
    seeded s draws what mlx-lm's make_sampler draws after mx.random.seed(s).
    """
    temperature, top_p, min_p, top_k = params.temperature, params.top_p, params.min_p, params.top_k
    if temperature == 0:
        return None
    filters: list[Callable[[mx.array], mx.array]] = []
    if 0 < top_p < 1.0:
        filters.append(lambda x: apply_top_p(x, top_p))
    if min_p != 0.0:
        filters.append(lambda x: apply_min_p(x, min_p))
    if top_k > 0:
        filters.append(lambda x: apply_top_k(x, top_k))
    key = mx.random.key(params.seed if params.seed is not None else int.from_bytes(os.urandom(7), "little"))
    state = {"key": key}

    def sample(logprobs: mx.array) -> mx.array:
        state["key"], subkey = mx.random.split(state["key"])
        for keep in filters:
            logprobs = keep(logprobs)
        return mx.random.categorical(logprobs * (1 / temperature), key=subkey)

    return sample


def make_processors(params: SamplingParams) -> list[LogitsProcessor]:
    """The row's logits processors in mlx-lm's order (logit bias, then the repetition, presence and
    frequency penalties over the last `repetition_context_size` tokens), then the request's own."""
    if not params.processes_logits:
        return []
    context = params.repetition_context_size
    processors: list[LogitsProcessor] = list(
        make_logits_processors(
            logit_bias=dict(params.logit_bias) or None,
            repetition_penalty=params.repetition_penalty,
            repetition_context_size=context,
            presence_penalty=params.presence_penalty or None,
            presence_context_size=context,
            frequency_penalty=params.frequency_penalty or None,
            frequency_context_size=context,
        )
    )
    return processors + list(params.logits_processors)


def token_logprobs(logprobs: mx.array, tokens: list[int], top: int) -> list[TokenLogprobs]:
    """Each row's chosen token's log probability and its `top` best, from (rows, vocab) logprobs."""
    chosen: list[float] = mx.take_along_axis(logprobs, mx.array(tokens)[:, None], axis=-1)[:, 0].tolist()  # type: ignore[assignment]
    if top <= 0:
        return [TokenLogprobs(float(value)) for value in chosen]
    best = mx.argpartition(-logprobs, kth=top - 1, axis=-1)[:, :top]
    ids: list[list[int]] = best.tolist()  # type: ignore[assignment]
    values: list[list[float]] = mx.take_along_axis(logprobs, best, axis=-1).tolist()  # type: ignore[assignment]
    out = []
    for value, row_ids, row_values in zip(chosen, ids, values, strict=True):
        ranked = sorted(zip(row_ids, row_values, strict=True), key=lambda pair: -pair[1])
        out.append(TokenLogprobs(float(value), tuple((int(i), float(v)) for i, v in ranked)))
    return out


def ends_row(processors: list[LogitsProcessor], token: int) -> bool:
    """Whether a processor (a grammar that is complete, say) ends its row on `token`."""
    return any(getattr(processor, "ends_row", _never)(token) for processor in processors)


def checks_drafts(processors: list[LogitsProcessor]) -> bool:
    """Whether every processor can mask a drafted step's positions (a grammar: engine/batch/grammar.py);
    others (penalties, logit bias) follow each token, so their rows run plainly."""
    return all(hasattr(processor, "draft_masks") for processor in processors)


def allowed_draft(processors: list[LogitsProcessor], draft: list[int]) -> tuple[list[int], np.ndarray]:
    """The longest prefix of `draft` every processor admits, and the tokens allowed at each of its
    positions and the one after ((len + 1, vocab) booleans): the drafted step's logits masks."""
    masks: np.ndarray | None = None
    for processor in processors:
        draft, allowed = processor.draft_masks(draft)  # type: ignore[attr-defined]
        masks = allowed if masks is None else masks[: len(draft) + 1] & allowed[: len(draft) + 1]
    assert masks is not None, "a row without processors drafts unmasked"
    return draft, masks[: len(draft) + 1]


def _never(token: int) -> bool:
    return False
