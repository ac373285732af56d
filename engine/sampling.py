"""What a request asks of generation (SamplingParams), and per-request samplers.

Each seeded request owns its random key, so its tokens do not depend on which other
requests share the batch.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_p

from engine.errors import InvalidRequestError

Sampler = Callable[[mx.array], mx.array]


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence is generated: one value from the request to the engine, never field by field."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first match
    stop_tokens: tuple[int, ...] = ()  # token ids that end the sequence besides the model's EOS

    def validate(self) -> None:
        """Raise InvalidRequestError for a value no model could honour."""
        max_tokens = self.max_tokens
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        validate_sampling(self.temperature, self.top_p, self.seed)
        stop = self.stop
        if isinstance(stop, str) or any(not isinstance(s, str) or not s for s in stop):
            raise InvalidRequestError("stop must be a list of non-empty strings")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_tokens):
            raise InvalidRequestError("stop_tokens must be non-negative integers")

    def sampler(self) -> Sampler | None:
        return make_sampler(self.temperature, self.top_p, self.seed)


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
    key = mx.random.key(seed if seed is not None else int.from_bytes(os.urandom(7), "little"))
    state = {"key": key}

    def sample(logprobs: mx.array) -> mx.array:
        state["key"], subkey = mx.random.split(state["key"])
        if top_p < 1.0:
            logprobs = apply_top_p(logprobs, top_p)
        return mx.random.categorical(logprobs * (1 / temperature), key=subkey)

    return sample
