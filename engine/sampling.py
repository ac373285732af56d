"""Per-request samplers. Each seeded request owns its random key, so its tokens do not
depend on which other requests share the batch."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_p

from engine.errors import InvalidRequestError

Sampler = Callable[[mx.array], mx.array]


def validate_sampling(temperature: float, top_p: float, seed: int | None) -> None:
    if not isinstance(temperature, int | float) or not temperature >= 0 or temperature > 100:
        raise InvalidRequestError(f"temperature must be a number in [0, 100], got {temperature!r}")
    if not isinstance(top_p, int | float) or not 0 < top_p <= 1:
        raise InvalidRequestError(f"top_p must be in (0, 1], got {top_p!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise InvalidRequestError(f"seed must be a non-negative integer, got {seed!r}")


def make_sampler(temperature: float, top_p: float, seed: int | None) -> Sampler | None:
    """None means greedy: the batch's shared argmax, one call for the whole batch."""
    if temperature == 0:
        return None
    key = mx.random.key(seed if seed is not None else int.from_bytes(__import__("os").urandom(7), "little"))
    state = {"key": key}

    def sample(logprobs: mx.array) -> mx.array:
        state["key"], subkey = mx.random.split(state["key"])
        if top_p < 1.0:
            logprobs = apply_top_p(logprobs, top_p)
        return mx.random.categorical(logprobs * (1 / temperature), key=subkey)

    return sample
