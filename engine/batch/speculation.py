"""Speculative decoding in the ragged batch from prompt-lookup drafts: a decoding row whose last
tokens occurred earlier in its own context (prompt + output) proposes the tokens that followed them
there, and the step verifies them in the same forward as its batch mates (the row runs 1 + k query
tokens, like a prefill chunk).

Why: one agent's answer decodes at one row's speed, and agent answers copy long spans of their
context (tool-call arguments quoting a file, a code edit rewriting a function it was shown): the next
tokens are often already there. Verifying k drafts costs one step of a few more tokens, which while
the step reads more weights than it computes (few rows) costs little more than one token.

Exact: greedy rows keep the longest prefix of the draft that equals the model's own argmax, plus the
model's token after it (the output is the one without speculation); sampled rows use speculative
sampling for a deterministic proposal (accept a draft token x with probability p(x), else draw from p
without x, renormalised), which keeps the sampler's distribution. Rejected positions are trimmed
without a copy: the row's caches just do not advance over them.

Adaptive: a row drafts only where its n-gram occurs earlier; a row whose drafts keep failing pauses
(longer each time); a step speculates only where the learnt cost says it pays: the tokens the
drafts are expected to add against what their extra query tokens cost, at this many decoding rows
(a large, compute-bound batch gains nothing). Rows run plainly (no drafts) where they have logits
processors (grammar, penalties, logit bias: their state follows each token) or caches other than
plain or quantized full attention (sliding windows, SSM state, MLA), and in models the ragged batch
does not run.
"""

from __future__ import annotations

import os
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from engine.core.params import SamplingParams

#: n-gram sizes looked up in a row's context, longest first.
NGRAM_SIZES = (4, 3, 2)
#: Draft lengths: a row starts at FIRST_DRAFT, doubles when all are accepted, halves when few are.
FIRST_DRAFT = 4
MIN_DRAFT = 2
MAX_DRAFT = 8
#: A row pauses after this many drafts in a row with nothing accepted (2, 4, ... 64 steps).
MISSES_BEFORE_PAUSE = 2
MAX_PAUSE_STEPS = 64
#: A row's acceptance before it has drafted, and the weight of its newest draft in the average.
PRIOR_ACCEPTANCE = 0.5
WEIGHT = 0.3
#: Every this many speculating steps at one row count, one runs plainly to re-measure its cost.
REMEASURE_EVERY = 64
#: After this many steps whose drafts the cost turned down, the best one drafts anyway: the cost and
#: the row's acceptance are measured again (a noisy step must not turn drafting off for good).
PROBE_EVERY = 8
#: Step times kept per estimate; the estimate is their median (robust to a step a neighbour slowed).
SAMPLES = 9


class SpeculatedStep(Protocol):
    decode_rows: int
    prompt_tokens: int
    draft_tokens: int
    accepted_tokens: int
    forward_s: float


class NgramIndex:
    """A row's context (append-only) and, for each n-gram, where it last ended before the last
    token: the lookup is a dict read a step, not a scan of the context."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self._last: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this position are in _last

    def sync(self, context: Sequence[int]) -> None:
        """Take in the context's new tokens (`context` extends what came before)."""
        self.tokens.extend(context[len(self.tokens) :])

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the context's last n-gram."""
        tokens, end = self.tokens, len(self.tokens) - 1
        for i in range(self._indexed, end):
            for n in NGRAM_SIZES:
                if i + 1 >= n:
                    self._last[tuple(tokens[i + 1 - n : i + 1])] = i
        self._indexed = max(self._indexed, end)
        for n in NGRAM_SIZES:
            if end + 1 >= n:
                at = self._last.get(tuple(tokens[end + 1 - n :]))
                if at is not None:
                    return tokens[at + 1 : at + 1 + k]
        return []


class SampledDraws:
    """A sampled row's distribution (mlx-lm's filters in make_sampler's order, then the temperature)
    and its own random key for the accept draws, seeded from the request's seed when it has one."""

    def __init__(self, params: SamplingParams) -> None:
        self.temperature = params.temperature
        self.top_p, self.min_p, self.top_k = params.top_p, params.min_p, params.top_k
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(7), "little")
        self.key = mx.random.key(seed + 1)  # not the sampler's own sequence

    def probabilities(self, logprobs: mx.array) -> mx.array:
        if 0 < self.top_p < 1.0:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.min_p != 0.0:
            logprobs = apply_min_p(logprobs, self.min_p)
        if self.top_k > 0:
            logprobs = apply_top_k(logprobs, self.top_k)
        return mx.softmax(logprobs * (1 / self.temperature), axis=-1)

    def verify(self, logprobs: mx.array, draft: list[int]) -> list[int]:
        """The row's tokens from (k + 1, vocab) logprobs at the draft's positions: the accepted
        draft tokens, then one drawn from the residual at the first rejection (or from the last
        position's distribution when all are accepted)."""
        probs = self.probabilities(logprobs)
        self.key, accept_key, draw_key = mx.random.split(self.key, 3)
        k = len(draft)
        p_draft = probs[mx.arange(k), mx.array(draft)]
        accepted: list[bool] = (mx.random.uniform(shape=(k,), key=accept_key) < p_draft).tolist()  # type: ignore[assignment]
        j = accepted.index(False) if False in accepted else k
        p = probs[j]
        if j < k:
            p = mx.where(mx.arange(p.shape[-1]) == draft[j], 0.0, p)
        token: int = mx.random.categorical(mx.log(p), key=draw_key).tolist()  # type: ignore[assignment]
        return draft[:j] + [token]


def accept_greedy(draft: list[int], targets: list[int]) -> list[int]:
    """The model's own tokens at the k + 1 positions, up to the first that differs from the draft:
    the accepted draft tokens and the model's token after them."""
    j = 0
    while j < len(draft) and targets[j] == draft[j]:
        j += 1
    return targets[: j + 1]


@dataclass
class RowSpeculation:
    """One row's drafting state."""

    sampled: SampledDraws | None = None  # None: greedy
    index: NgramIndex = field(default_factory=NgramIndex)
    draft_length: int = FIRST_DRAFT
    acceptance: float = PRIOR_ACCEPTANCE  # accepted / proposed, averaged over its drafts
    misses: int = 0  # drafts in a row with nothing accepted
    paused_until: int = 0  # the generator's step count
    proposed: int = 0
    accepted: int = 0

    def expected_tokens(self, k: int) -> float:
        """Draft tokens expected to be accepted out of k (each after the one before it)."""
        a = self.acceptance
        return sum(a**i for i in range(1, k + 1))

    def record(self, proposed: int, accepted: int, step: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        self.acceptance = (1 - WEIGHT) * self.acceptance + WEIGHT * accepted / proposed
        if accepted == proposed:
            self.draft_length = min(MAX_DRAFT, self.draft_length * 2)
        elif accepted * 2 < proposed:
            self.draft_length = max(MIN_DRAFT, self.draft_length // 2)
        if accepted:
            self.misses = 0
            return
        self.misses += 1
        if self.misses >= MISSES_BEFORE_PAUSE:
            self.paused_until = step + min(MAX_PAUSE_STEPS, 2 ** (self.misses - 1))


@dataclass
class SpeculationStats:
    steps: int = 0  # steps that verified drafts
    proposed: int = 0
    accepted: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


class Speculation:
    """The batch's drafting policy: which rows draft this step, from what steps cost here.

    A decode step of R rows costs plain_s[R]; each draft token on top costs draft_token_s (both
    learnt from the steps run, the first only from steps without prompt tokens). A set of drafts
    adding G expected tokens with D draft tokens pays when (R + G) / (plain + c D) beats R / plain;
    rows are taken best expected gain per token first while the next one still pays.
    """

    def __init__(self, always: bool = False) -> None:
        """`always`: every row with a draft drafts, whatever the cost (tests; a benchmark's bound)."""
        self.always = always
        self.plain_s: dict[int, float] = {}  # median plain decode step by decoding rows
        self.draft_token_s: float | None = None  # median cost a draft token adds
        self.stats = SpeculationStats()
        self._since_plain: dict[int, int] = {}
        self._turned_down = 0  # steps in a row whose drafts did not pay
        self._plain_samples: dict[int, deque[float]] = {}
        self._token_samples: deque[float] = deque(maxlen=SAMPLES)

    def plan(
        self, candidates: list[tuple[Any, RowSpeculation]], decode_rows: int, step: int, extra_s: float
    ) -> dict[int, list[int]]:
        """Drafts for this step by row uid. `candidates` are (row, state) of rows that may draft;
        `extra_s` is what the step's prompt tokens add to its cost."""
        plain = self.plain_s.get(decode_rows)
        if (plain is None and not self.always) or not candidates:
            return {}  # first measure what a plain step of this many rows costs
        if self._since_plain.get(decode_rows, 0) >= REMEASURE_EVERY and not self.always:
            self._since_plain[decode_rows] = 0
            return {}
        base = (plain or 0.0) + extra_s
        per_token = self.draft_token_s or 0.0
        offers = []
        for row, state in candidates:
            if state.paused_until > step and not self.always:
                continue
            room = row.max_tokens - len(row.sampled) - 1
            k = min(state.draft_length, room)
            if k <= 0:
                continue
            state.index.sync(row.cached_tokens + row.pending)
            draft = state.index.propose(k)
            if draft:
                offers.append((state.expected_tokens(len(draft)) / len(draft), row.uid, draft, state))
        offers.sort(key=lambda offer: -offer[0])
        chosen: dict[int, list[int]] = {}
        gain, draft_tokens = 0.0, 0
        for _, uid, draft, state in offers:
            g = state.expected_tokens(len(draft))
            if not self.always and g * (base + per_token * draft_tokens) <= (
                decode_rows + gain
            ) * per_token * len(draft):
                break
            chosen[uid] = draft
            gain += g
            draft_tokens += len(draft)
        if offers and not chosen:
            self._turned_down += 1
            if self._turned_down >= PROBE_EVERY:
                _, uid, draft, _ = offers[0]
                chosen[uid] = draft
        if chosen:
            self._turned_down = 0
        return chosen

    def record_step(self, step: SpeculatedStep) -> None:
        """Learn from a step's time: a plain decode step sets its row count's cost, a speculating
        one without prompt tokens what its draft tokens added."""
        if step.draft_tokens:
            self.stats.steps += 1
            self.stats.proposed += step.draft_tokens
            self.stats.accepted += step.accepted_tokens
        decode_rows, draft_tokens, forward_s = step.decode_rows, step.draft_tokens, step.forward_s
        if forward_s <= 0 or decode_rows == 0 or step.prompt_tokens:
            return
        if not draft_tokens:
            samples = self._plain_samples.setdefault(decode_rows, deque(maxlen=SAMPLES))
            samples.append(forward_s)
            self.plain_s[decode_rows] = statistics.median(samples)
            return
        self._since_plain[decode_rows] = self._since_plain.get(decode_rows, 0) + 1
        plain = self.plain_s.get(decode_rows)
        if plain is None:
            return
        self._token_samples.append(max(0.0, forward_s - plain) / draft_tokens)
        self.draft_token_s = statistics.median(self._token_samples)


def can_draft(row: Any) -> bool:
    """Whether a row may draft: no logits processors (their state follows each token), and only
    caches a trim rolls back (plain or quantized full attention)."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    return not row.processors and all(type(layer) in (KVCache, QuantizedKVCache) for layer in row.layers)
