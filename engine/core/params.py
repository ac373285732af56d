"""SamplingParams: what a request asks of generation, as one value from the request to the engine.

Pure Python (no MLX), so the worker's scheduling code and its tests can build and check
requests without loading a model.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
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


def validate_sampling(temperature: float, top_p: float, seed: int | None) -> None:
    if not isinstance(temperature, int | float) or not temperature >= 0 or temperature > 100:
        raise InvalidRequestError(f"temperature must be a number in [0, 100], got {temperature!r}")
    if not isinstance(top_p, int | float) or not 0 < top_p <= 1:
        raise InvalidRequestError(f"top_p must be in (0, 1], got {top_p!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise InvalidRequestError(f"seed must be a non-negative integer, got {seed!r}")
