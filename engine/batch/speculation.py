"""Speculative decoding in the ragged batch: a decoding row proposes k tokens (engine/batch/drafters.py:
by default what followed the latest earlier occurrence of its last tokens in its own context, or a
small draft model's guesses) and the step verifies them in the same forward as its batch mates (the
row runs 1 + k query tokens, like a prefill chunk).

Why: one agent's answer decodes at one row's speed, and agent answers copy long spans of their
context (tool-call arguments quoting a file, a code edit rewriting a function it was shown): the next
tokens are often already there. Verifying k drafts costs one step of a few more tokens, which while
the step reads more weights than it computes (few rows) costs little more than one token.

Exact: greedy rows keep the longest prefix of the draft that equals the model's own argmax, plus the
model's token after it (the output is the one without speculation); sampled rows use speculative
sampling for a deterministic proposal (accept a draft token x with probability p(x), else draw from p
without x, renormalised), which keeps the sampler's distribution. Rejected positions are trimmed
without a copy: the row's caches just do not advance over them.

Adaptive: a row drafts only where its drafter has a guess (its n-gram occurs earlier); a row whose
drafts keep failing pauses (longer each time); a step speculates only where the learnt cost says it
pays: the tokens the drafts are expected to add against what their extra query tokens (and a draft
model's forwards) cost, at this many decoding rows (a large, compute-bound batch gains nothing).
A grammar row (structured output, a forced tool call) drafts only the part of its draft its grammar
admits, and each drafted position's logits are masked in the grammar's state after the drafts before
it (engine/batch/grammar.py: consumed, then rolled back), so its tokens are those it gives without
drafts. Rows run plainly (no drafts) where they have other logits processors (penalties, logit bias:
their state follows each token) or caches a trim cannot roll back (SSM state), and in models the
ragged batch does not run. Sliding-window layers draft (their WindowKVCache holds its tokens in order,
so a trim drops the rejected ones and keeps the window), and so do MLA's latent caches (KVCaches).
"""

from __future__ import annotations

import os
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from engine.batch.drafters import Drafter, NgramIndex, RowDrafter
from engine.batch.sampling import checks_drafts
from engine.core.params import SamplingParams
from engine.kv.window import WindowKVCache

#: Draft lengths: a row starts at FIRST_DRAFT, doubles when all are accepted, halves when few are.
#: MAX_DRAFT fills a lone row's step to 16 query tokens: matmuls run fastest at 16-row multiples
#: (engine/cpu/gemm_rows.py), so on the CPU a 16-token forward of one row cost 1.79x a 1-token one,
#: no more than 8 tokens (1.75x) and less than 9-12 (1.97-2.53x); at batch 1 it decoded 6-31% more
#: tokens a second than a cap of 8 (benchmarks/README.md). Larger batches draft where the cost says.
FIRST_DRAFT = 4
MIN_DRAFT = 2
MAX_DRAFT = 15
#: A row pauses after this many drafts in a row with nothing accepted (2, 4, ... 64 steps).
MISSES_BEFORE_PAUSE = 2
MAX_PAUSE_STEPS = 64
#: A row's acceptance before it has drafted, and the weight of its newest draft in the average.
PRIOR_ACCEPTANCE = 0.5
WEIGHT = 0.3
#: Every this many speculating steps at one row count, one runs plainly to re-measure its cost.
REMEASURE_EVERY = 64
#: After this many steps whose drafts the cost turned down, the best one drafts anyway: the cost and
#: the row's acceptance are measured again (a noisy step must not turn drafting off for good). Each
#: probe that the cost still turns down doubles the wait, up to MAX_PROBE_EVERY. A probe costs most
#: where it is least likely to pay (a drafted step of 16 rows on the CPU runs as 32 matmul rows: a
#: second step), so probes are rare: one in the first 32 turned-down steps, then 64, 128, 256.
PROBE_EVERY = 32
MAX_PROBE_EVERY = 256
#: A draft model's probe waits until its own work (catch-up and guesses) is at most this share of the
#: time the steps turned down since the last probe took.
PROBE_SHARE = 0.1
#: A step drafts only where the cost says its tokens per second gain at least this factor: a
#: prediction within the noise of a step's time is no reason to pay a draft's extra work.
MIN_GAIN = 1.05
#: A draft model's catch-up with a row's context is charged to the drafts of the row's next this many
#: tokens at most, a share to each.
CATCH_UP_SPREAD = 256
#: Step times kept per estimate; the estimate is their median (robust to a step a neighbour slowed),
#: taken as founded from MIN_SAMPLES of them.
SAMPLES = 9
MIN_SAMPLES = 3


class SpeculatedStep(Protocol):
    decode_rows: int
    prompt_tokens: int
    draft_tokens: int
    accepted_tokens: int
    step_s: float


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
    drafter: RowDrafter = field(default_factory=NgramIndex)  # engine/batch/drafters.py
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


class StepTimes:
    """What a decode step (no prompt tokens) costs by its query tokens (rows + draft tokens), the
    median of its latest times; steps with drafts and without are kept apart (a drafted step also
    moves its rows out of the ShortSlots, a plain one of as many tokens does not).

    Why by tokens and not a cost per draft token: on the CPU a step's matmuls run at 16 or 32 rows
    (engine/cpu/gemm_rows.py), so its cost is a staircase: 10 rows plus 6 drafts cost what 10 rows do,
    16 rows plus 4 drafts twice 16 rows. So a count is kept as the rows its step runs as (`step_rows`:
    20 to 31 tokens are one figure, 32 rows, there), and a count not measured yet is read off its
    neighbours."""

    def __init__(self, step_rows: Callable[[int], int] | None = None) -> None:
        self._step_rows = step_rows or (lambda tokens: tokens)
        self._rows_of: dict[int, int] = {}  # step_rows' answers: it reads the CPU switches each call
        self._samples: dict[tuple[bool, int], deque[float]] = {}
        self.plain: dict[int, float] = {}  # by the rows a step runs as
        self.drafted: dict[int, float] = {}  # likewise, rows + draft tokens
        self._last_drafted: int | None = None  # the latest drafted step recorded

    def step_rows(self, tokens: int) -> int:
        """The rows a step of `tokens` query tokens runs as, worked out once per count."""
        rows = self._rows_of.get(tokens)
        if rows is None:
            rows = self._rows_of[tokens] = self._step_rows(tokens)
        return rows

    def plain_step(self, rows: int) -> float | None:
        """A plain decode step of `rows` rows, where measured."""
        return self.plain.get(self.step_rows(rows))

    def record(self, tokens: int, drafted: bool, seconds: float) -> None:
        tokens = self.step_rows(tokens)
        samples = self._samples.setdefault((drafted, tokens), deque(maxlen=SAMPLES))
        samples.append(seconds)
        (self.drafted if drafted else self.plain)[tokens] = statistics.median(samples)
        if drafted:
            self._last_drafted = tokens

    def charge_last_drafted(self, seconds: float) -> None:
        """Add to the latest drafted step what it left to the step after it (its rows' copies back
        into the ShortSlots): a draft costs both, so the policy weighs both."""
        if self._last_drafted is None:
            return
        samples = self._samples[(True, self._last_drafted)]
        samples[-1] += seconds
        self.drafted[self._last_drafted] = statistics.median(samples)
        self._last_drafted = None

    def estimate(self, tokens: int, drafted: bool, prior: float | None = None) -> tuple[float, bool] | None:
        """A step of `tokens` query tokens and whether the figure is founded: measured, else
        interpolated between the nearest known counts (a drafted step's own where measured), else
        extended from the two largest (or the largest alone: its cost). Founded: it rests on counts
        measured MIN_SAMPLES times and is no extension (one step's time on a loaded machine says
        little, and a guess is tried by one more draft at most). None: nothing known.

        `prior`: what the step would cost if each token beyond the plain step's cost what a prompt
        token does (StepCost's figure). Where it is given, a figure not founded yet is the lower of
        it and what was measured, and a guess is the prior itself: both count as founded. Optimism
        where nothing is known is the exploration (a draft that pays there is timed, and its own
        figure takes over once founded); a count the prior already prices out, such as a full batch
        on a compute-bound step, is never tried, only probed."""
        tokens = self.step_rows(tokens)
        known = {**self.plain, **self.drafted} if drafted else self.plain
        if tokens in known:
            return self._or_prior(known[tokens], self._founded(tokens, drafted), prior)
        below = [t for t in known if t < tokens]
        above = [t for t in known if t > tokens]
        if below and above:
            lo, hi = max(below), min(above)
            value = known[lo] + (known[hi] - known[lo]) * (tokens - lo) / (hi - lo)
            return self._or_prior(value, self._founded(lo, drafted) and self._founded(hi, drafted), prior)
        if prior is not None:
            return prior, True
        if above:
            return known[min(above)], self._founded(min(above), drafted)
        if not below:
            return None
        top = sorted(below)[-2:]
        if len(top) < 2:
            return known[top[0]], False
        slope = max(0.0, (known[top[1]] - known[top[0]]) / (top[1] - top[0]))
        return known[top[1]] + slope * (tokens - top[1]), False

    @staticmethod
    def _or_prior(value: float, founded: bool, prior: float | None) -> tuple[float, bool]:
        if founded or prior is None:
            return value, founded
        return min(value, prior), True

    def _founded(self, tokens: int, drafted: bool) -> bool:
        """Whether the figure `estimate` reads at `tokens` was measured MIN_SAMPLES times."""
        own = self._samples.get((drafted, tokens)) if drafted and tokens in self.drafted else None
        samples = own if own is not None else self._samples.get((False, tokens), ())
        return len(samples) >= MIN_SAMPLES


@dataclass
class Offer:
    """A row that may draft this step: its draft (None: a model's, run only if the row is picked)."""

    value: float  # expected accepted tokens per draft token
    row: Any
    length: int
    state: RowSpeculation
    draft: list[int] | None
    catch_up_s: float = 0.0  # its share of a draft model's catch-up with the row's context


class Speculation:
    """The batch's drafting policy: which rows draft this step, from what steps cost here.

    Steps are timed whole (drafting, the slots' moves, the forward, the verify) by their query
    tokens (StepTimes). Offers are taken best expected accepted tokens per draft token first, and
    the step drafts the prefix of them with the most expected tokens per second, R + G over the
    step's cost at R + D tokens, where that beats R over a plain step's by MIN_GAIN; else none.
    """

    def __init__(
        self,
        always: bool = False,
        step_rows: Callable[[int], int] | None = None,
        drafter: Drafter | None = None,
    ) -> None:
        """`always`: every row with a draft drafts, whatever the cost (tests; a benchmark's bound).
        `step_rows`: the rows a step of so many query tokens runs as (StepTimes).
        `drafter`: where the rows' drafts come from (None: a prompt lookup); a draft model's drafts
        are run only for the rows a step picks, and priced at its own time per token."""
        self.always = always
        self.drafts_cost_forwards = drafter is not None and drafter.runs_a_model
        self.times = StepTimes(step_rows)
        self.stats = SpeculationStats()
        self._since_plain: dict[int, int] = {}
        self._turned_down = 0  # steps in a row whose drafts did not pay
        self._turned_down_s = 0.0  # and what they cost (plain steps)
        self._probe_every = PROBE_EVERY
        self._last_drafted = False  # the last step recorded had drafts
        self._draft_times: deque[float] = deque(maxlen=SAMPLES)  # a draft model's seconds per token
        if drafter is not None and drafter.token_s:
            self._draft_times.append(drafter.token_s)
        self.draft_prompt_s = 0.0 if drafter is None else drafter.prompt_token_s  # a context token read

    @property
    def draft_token_s(self) -> float:
        """What a draft model takes to guess one token (its forwards; 0 for a lookup, or before it
        ran): added to a draft token's price, so a draft model slower than it pays is not run."""
        return statistics.median(self._draft_times) if self._draft_times else 0.0

    def _catch_up_share(self, row: Any, state: RowSpeculation, length: int) -> float:
        """The part of a draft model's catch-up with the row's context (read once, then kept) that
        this step's draft is charged: the whole spread over the drafts its next tokens would take
        (CATCH_UP_SPREAD at most: max_tokens says little of an answer's length)."""
        behind = state.drafter.behind(len(row.cached_tokens) + len(row.pending))
        if not behind:
            return 0.0
        tokens_left = min(CATCH_UP_SPREAD, max(1, row.max_tokens - len(row.sampled)))
        drafts_left = max(1.0, tokens_left / (1 + state.expected_tokens(length)))
        return behind * self.draft_prompt_s / drafts_left

    def _drafts(self, offers: Sequence[Offer]) -> dict[int, list[int]]:
        """The picked offers' drafts by row uid (a model's run now, its cost kept; a row it had no
        guess for drops out)."""
        out = {}
        for offer in offers:
            draft = offer.draft
            if draft is None:
                drafter = offer.state.drafter
                draft = drafter.draft(offer.row.cached_tokens + offer.row.pending, offer.length)
                if draft:
                    self._draft_times.append(drafter.token_s)
            if draft:
                out[offer.row.uid] = draft
        return out

    def plan(
        self,
        candidates: list[tuple[Any, RowSpeculation]],
        decode_rows: int,
        step: int,
        extra_s: float,
        token_s: float | None = None,
    ) -> dict[int, list[int]]:
        """Drafts for this step by row uid. `candidates` are (row, state) of rows that may draft;
        `extra_s` is what the step's prompt tokens add to its cost; `token_s` what one prompt token
        costs in a step (StepCost), the prior for draft tokens not timed yet (StepTimes.estimate)."""
        plain_s = self.times.plain_step(decode_rows)
        if (plain_s is None and not self.always) or not candidates:
            return {}  # first measure what a plain step of this many rows costs
        if self._since_plain.get(decode_rows, 0) >= REMEASURE_EVERY and not self.always:
            self._since_plain[decode_rows] = 0
            return {}
        lazy = self.drafts_cost_forwards
        offers: list[Offer] = []
        for row, state in candidates:
            if state.paused_until > step and not self.always:
                continue
            room = row.max_tokens - len(row.sampled) - 1
            k = min(state.draft_length, room)
            if k <= 0:
                continue
            # A model's drafts are run only for the rows picked below; a lookup shows what it has now.
            draft = None if lazy else state.drafter.draft(row.cached_tokens + row.pending, k)
            if draft is None or draft:
                length = k if draft is None else len(draft)
                offer = Offer(state.expected_tokens(length) / length, row, length, state, draft)
                if lazy:
                    offer.catch_up_s = self._catch_up_share(row, state, length)
                offers.append(offer)
        if not offers:
            return {}
        offers.sort(key=lambda offer: -offer.value)
        if self.always:
            return self._drafts(offers)
        # A draft that would not pay even if its tokens cost nothing is never tried (nor probed).
        offers = [
            o for o in offers if decode_rows + o.state.expected_tokens(o.length) >= MIN_GAIN * decode_rows
        ]
        if not offers:
            return {}
        assert plain_s is not None
        # A draft token costs what a prompt token does in the step, and a draft model's time to guess
        # it: the latter alone is a price once known (StepCost may have no figure yet).
        price = token_s
        if self.draft_token_s:
            price = (token_s or 0.0) + self.draft_token_s
        best_rate, best = MIN_GAIN * decode_rows / (plain_s + extra_s), 0
        gain, draft_tokens, catch_up_s = 0.0, 0, 0.0
        for i, offer in enumerate(offers, start=1):
            gain += offer.state.expected_tokens(offer.length)
            draft_tokens += offer.length
            catch_up_s += offer.catch_up_s
            prior = None if price is None else plain_s + draft_tokens * price
            estimate = self.times.estimate(decode_rows + draft_tokens, drafted=True, prior=prior)
            assert estimate is not None  # the plain step of decode_rows is known
            cost, founded = estimate
            rate = (decode_rows + gain) / (cost + extra_s + catch_up_s)
            if rate > best_rate:
                best_rate, best = rate, i
            if not founded:  # a guess: one draft more than founded figures cover, at most, is tried
                if i == 1:
                    best = 1  # and the first offer's size is timed until founded, whatever it says
                break
        if best:
            self._turned_down, self._turned_down_s, self._probe_every = 0, 0.0, PROBE_EVERY
            return self._drafts(offers[:best])
        self._turned_down += 1
        self._turned_down_s += plain_s
        if self._turned_down < self._probe_every or not self._may_probe(offers[0]):
            return {}
        self._turned_down, self._turned_down_s = 0, 0.0
        self._probe_every = min(MAX_PROBE_EVERY, self._probe_every * 2)
        return self._drafts(offers[:1])

    def _may_probe(self, offer: Offer) -> bool:
        """Whether a probe's draft-model work (its catch-up with the row's context, whole, and its
        guesses) is within PROBE_SHARE of the steps turned down since the last probe: a lookup's
        always is; a draft model slower than the model never gets to probe."""
        if offer.draft is not None:
            return True
        behind = offer.state.drafter.behind(len(offer.row.cached_tokens) + len(offer.row.pending))
        work_s = behind * self.draft_prompt_s + offer.length * self.draft_token_s
        return work_s <= PROBE_SHARE * self._turned_down_s

    def record_step(self, step: SpeculatedStep) -> None:
        """Learn from a step's time: a decode step without prompt tokens sets the cost of its
        query tokens, plain or drafted."""
        if step.draft_tokens:
            self.stats.steps += 1
            self.stats.proposed += step.draft_tokens
            self.stats.accepted += step.accepted_tokens
        decode_rows, draft_tokens = step.decode_rows, step.draft_tokens
        after_draft, self._last_drafted = self._last_drafted, bool(draft_tokens)
        if step.step_s <= 0 or decode_rows == 0 or step.prompt_tokens:
            return
        if after_draft and not draft_tokens:
            # It carries the drafted rows' copies back into the ShortSlots: not a plain step's cost,
            # but part of the draft's (what it took over a plain step of as many rows).
            plain = self.times.plain_step(decode_rows)
            if plain is not None:
                self.times.charge_last_drafted(max(0.0, step.step_s - plain))
            return
        self._since_plain[decode_rows] = self._since_plain.get(decode_rows, 0) + 1 if draft_tokens else 0
        self.times.record(decode_rows + draft_tokens, bool(draft_tokens), step.step_s)


def can_draft(row: Any) -> bool:
    """Whether a row may draft: no logits processors but a grammar (the others' state follows each
    token; a grammar masks each drafted position: engine/batch/grammar.py), and only caches a trim
    rolls back (plain or quantized full attention, sliding windows in token order)."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    trimmable = (KVCache, QuantizedKVCache, WindowKVCache)
    return checks_drafts(row.processors) and all(type(layer) in trimmable for layer in row.layers)
