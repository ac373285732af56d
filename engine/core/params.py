"""SamplingParams: what a request asks of generation, as one value from the request to the engine.

Pure Python (no MLX), so the worker's scheduling code and its tests can build and check
requests without loading a model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.core.errors import InvalidRequestError

#: mlx-lm's logits processor: (the row's tokens so far, prompt included; its (1, vocab) logits) -> logits.
#: A processor may also have `ends_row(token) -> bool`: True ends its row on that token ("stop").
LogitsProcessor = Callable[[Any, Any], Any]

MAX_TOP_LOGPROBS = 20


#: Whitespace between JSON tokens in a grammar: a space or two, or one line break and its indent.
#: Unbounded whitespace (llguidance's default) let a small model loop on newlines until max_tokens,
#: cutting the document; a schema's own "x-guidance" options replace this.
JSON_WHITESPACE = r"([ \t]{0,2}|\n[ \t]{0,24})"


def with_json_whitespace(schema: Any) -> Any:
    """`schema` with kvrq's whitespace rule, unless it sets llguidance's "x-guidance" options itself."""
    if isinstance(schema, dict) and "x-guidance" not in schema:
        return {**schema, "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}
    return schema


@dataclass(frozen=True)
class OutputGrammar:
    """What a row's output must match, enforced token by token (engine/batch/grammar.py).

    `source` is text (a JSON schema as JSON, or a Lark grammar), so the value is hashable and
    compiled once per distinct grammar; `what` names it in errors ("response_format's schema").
    """

    kind: Literal["json_schema", "lark"]
    source: str
    what: str = field(default="grammar", compare=False)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first match
    stop_tokens: tuple[int, ...] = ()  # token ids that end the sequence besides the model's EOS
    top_k: int = 0  # 0: every token
    min_p: float = 0.0
    repetition_penalty: float | None = None
    repetition_context_size: int = 20  # the last tokens all three penalties look at
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    logprobs: bool = False  # each generated token's log probability (after the logits processors)
    top_logprobs: int = 0  # and this many most likely tokens of its step
    logits_processors: tuple[LogitsProcessor, ...] = ()  # more per-row processors, applied last
    grammar: OutputGrammar | None = None  # the output must match it (applied after every processor)

    def validate(self, vocab_size: int = 0) -> None:
        """Raise InvalidRequestError for a value no model could honour (`vocab_size`: 0 if unknown)."""
        max_tokens = self.max_tokens
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        validate_sampling(self.temperature, self.top_p, self.seed)
        stop = self.stop
        if isinstance(stop, str) or any(not isinstance(s, str) or not s for s in stop):
            raise InvalidRequestError("stop must be a list of non-empty strings")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_tokens):
            raise InvalidRequestError("stop_tokens must be non-negative integers")
        self._validate_processors(vocab_size)

    def _validate_processors(self, vocab_size: int) -> None:
        if not _is_int(self.top_k) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be a non-negative integer, got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p!r}")
        penalty = self.repetition_penalty
        if penalty is not None and (not _is_number(penalty) or not penalty > 0):
            raise InvalidRequestError(f"repetition_penalty must be positive, got {penalty!r}")
        if not _is_int(self.repetition_context_size) or self.repetition_context_size <= 0:
            raise InvalidRequestError(
                f"repetition_context_size must be a positive integer, got {self.repetition_context_size!r}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if not _is_number(getattr(self, name)):
                raise InvalidRequestError(f"{name} must be a number, got {getattr(self, name)!r}")
        for token, bias in self.logit_bias:
            if not _is_int(token) or token < 0 or (vocab_size and token >= vocab_size):
                where = f" [0, {vocab_size})" if vocab_size else ""
                raise InvalidRequestError(f"logit_bias token id {token!r} is outside the vocabulary{where}")
            if not _is_number(bias):
                raise InvalidRequestError(f"logit_bias[{token}] must be a number, got {bias!r}")
        top = self.top_logprobs
        if not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top!r}")
        if top and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs")

    @property
    def processes_logits(self) -> bool:
        """Whether the row has any logits processor (the batch's plain greedy path skips them all)."""
        return bool(
            self.logit_bias
            or self.repetition_penalty
            or self.presence_penalty
            or self.frequency_penalty
            or self.logits_processors
            or self.grammar
        )


def validate_sampling(temperature: float, top_p: float, seed: int | None) -> None:
    if not isinstance(temperature, int | float) or not temperature >= 0 or temperature > 100:
        raise InvalidRequestError(f"temperature must be a number in [0, 100], got {temperature!r}")
    if not isinstance(top_p, int | float) or not 0 < top_p <= 1:
        raise InvalidRequestError(f"top_p must be in (0, 1], got {top_p!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise InvalidRequestError(f"seed must be a non-negative integer, got {seed!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value  # not NaN
