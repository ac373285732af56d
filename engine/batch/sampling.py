"""Per-request samplers. Each seeded request owns its random key, so its tokens do not
depend on which other requests share the batch."""

from __future__ import annotations

import os
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_p

from engine.core.params import SamplingParams

Sampler = Callable[[mx.array], mx.array]


def make_sampler(params: SamplingParams) -> Sampler | None:
    """None means greedy: the batch's shared argmax, one call for the whole batch."""
    temperature, top_p, seed = params.temperature, params.top_p, params.seed
    if temperature == 0:
        return None
    key = mx.random.key(seed if seed is not None else int.from_bytes(os.urandom(7), "little"))
    state = {"key": key}

    def sample(logprobs: mx.array) -> mx.array:
        state["key"], subkey = mx.random.split(state["key"])
        if top_p < 1.0:
            logprobs = apply_top_p(logprobs, top_p)
        return mx.random.categorical(logprobs * (1 / temperature), key=subkey)

    return sample
