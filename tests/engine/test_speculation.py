"""Speculative decoding in the ragged batch (engine/batch/speculation.py) on tiny random models:
greedy tokens identical with and without it, whatever the drafts; sampled rows keep the sampler's
distribution; rows that cannot draft run plainly."""

from __future__ import annotations

import math
import os
import random
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import pytest

from engine.batch.drafters import NgramIndex
from engine.batch.engine import SPECULATION_DEFAULT, BlockPoolBatchEngine
from engine.batch.speculation import (
    MIN_SAMPLES,
    RowSpeculation,
    SampledDraws,
    Speculation,
    accept_greedy,
)
from engine.core.params import SamplingParams
from engine.core.results import Completion
from tests.engine.test_ragged import prompt, run_all
from tests.engine.tiny import QUANTIZABLE, ByteTokenizer, tiny_model

pytestmark = pytest.mark.mlx_path  # run again with KVRQ_CPU_SHORTCUTS=0 by .ci/test


@pytest.fixture(scope="module")
def model() -> object:
    return tiny_model("llama")


def make_engine(model: object, speculation: bool, **kwargs: object) -> BlockPoolBatchEngine:
    options: dict[str, object] = {"pool_blocks": 256, "max_batch": 8, "max_context": 4096, **kwargs}
    engine = BlockPoolBatchEngine(
        model,
        ByteTokenizer(),
        model_name="tiny-llama",
        speculation=speculation,
        **options,  # type: ignore[arg-type]
    )
    if engine.speculation is not None:
        engine.speculation.always = True  # draft wherever a draft exists: the path under test
    return engine


PROMPTS = [prompt(40, salt) * 3 for salt in range(3)] + [prompt(300, salt=9)]


def generate(
    model: object, speculation: bool, prompts: list[list[int]], params: SamplingParams, **kwargs: object
) -> tuple[list[list[int]], BlockPoolBatchEngine]:
    engine = make_engine(model, speculation, **kwargs)
    try:
        uids = [engine.submit(None, p, params) for p in prompts[:2]]
        engine.step()
        uids += [engine.submit(None, p, params) for p in prompts[2:]]  # joiners while others decode
        done = run_all(engine)
    finally:
        engine.close()
    return [done[uid].token_ids for uid in uids], engine


def oracle_drafts(
    monkeypatch: pytest.MonkeyPatch, prompts: list[list[int]], outputs: list[list[int]], corrupt: float
) -> None:
    """Drafts are the row's true continuation (from a run without speculation), each token replaced
    by another with probability `corrupt`: drafts accepted whole, in part, and not at all."""
    rng = random.Random(7)

    def propose(self: NgramIndex, k: int) -> list[int]:
        for p, out in zip(prompts, outputs, strict=True):
            if self.tokens[: len(p)] == p:
                done = len(self.tokens) - len(p)
                return [t if rng.random() >= corrupt else 1 + (t + 1) % 250 for t in out[done : done + k]]
        raise AssertionError("a row whose prompt is not one of the test's")

    monkeypatch.setattr(NgramIndex, "propose", propose)


def test_accept_greedy_keeps_the_matching_prefix_and_the_models_next_token() -> None:
    assert accept_greedy([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert accept_greedy([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert accept_greedy([5, 6, 7], [4, 6, 7, 8]) == [4]


def test_ngram_lookup_proposes_what_followed_the_latest_earlier_occurrence() -> None:
    index = NgramIndex()
    index.sync([1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 7, 1, 2, 3])
    assert index.propose(3) == [5, 6, 7], "the latest earlier '1 2 3' was followed by 5 6 7"
    index.sync([1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 7, 1, 2, 3, 5, 8])
    assert index.propose(2) == [], "'5 8' and '8' never occurred before"
    index.sync([1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 7, 1, 2, 3, 5, 8, 4, 9])
    assert index.propose(4) == [1, 2, 3, 5]


def test_ngram_lookup_follows_the_occurrence_matching_furthest_back_then_the_latest() -> None:
    index = NgramIndex()
    index.sync([7, 1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 6, 7, 1, 2, 3, 4])
    assert index.propose(3) == [5, 9, 1], "'7 1 2 3 4' occurred first: what followed it, not the latest"
    index.sync([7, 1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 6, 7, 1, 2, 3, 4, 8, 1, 2, 3, 4])
    assert index.propose(3) == [8, 1, 2], "no occurrence matches further back than '1 2 3 4': the latest"


def test_greedy_tokens_are_the_same_with_and_without_prompt_lookup_drafts(model: object) -> None:
    params = SamplingParams(max_tokens=120, stop_tokens=())
    plain, _ = generate(model, False, PROMPTS, params)
    drafted, engine = generate(model, True, PROMPTS, params)
    assert drafted == plain
    assert engine.speculation is not None and engine.speculation.stats.accepted > 50, "drafts were verified"


@pytest.mark.parametrize("corrupt", [0.0, 0.2, 0.6])
def test_greedy_tokens_are_the_same_whatever_part_of_the_drafts_is_wrong(
    model: object, monkeypatch: pytest.MonkeyPatch, corrupt: float
) -> None:
    params = SamplingParams(max_tokens=60, stop_tokens=())
    plain, _ = generate(model, False, PROMPTS, params)
    oracle_drafts(monkeypatch, PROMPTS, plain, corrupt)
    drafted, engine = generate(model, True, PROMPTS, params)
    assert drafted == plain
    stats = engine.speculation.stats  # type: ignore[union-attr]
    assert stats.accepted > 0
    if corrupt:
        assert stats.accepted < stats.proposed, "some drafts were rejected and trimmed"


def test_a_stop_token_or_max_tokens_inside_an_accepted_draft_ends_the_row_there(
    model: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference, _ = generate(model, False, PROMPTS, SamplingParams(max_tokens=80, stop_tokens=()))
    # a token each output reaches after some tokens: its first occurrence past the 10th token
    stop = next(t for t in reference[0][10:] if t != reference[0][0])
    oracle_drafts(monkeypatch, PROMPTS, reference, 0.0)
    for params in (
        SamplingParams(max_tokens=80, stop_tokens=(stop,)),
        SamplingParams(max_tokens=37, stop_tokens=()),
    ):
        plain, _ = generate(model, False, PROMPTS, params)
        drafted, engine = generate(model, True, PROMPTS, params)
        assert drafted == plain
        assert engine.speculation is not None and engine.speculation.stats.accepted > 0
    assert any(len(out) < 80 for out in plain), "the stop token ended a row early"


def test_logprobs_and_stop_strings_are_the_same_with_drafts(
    model: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference, _ = generate(model, False, PROMPTS, SamplingParams(max_tokens=60, stop_tokens=()))
    oracle_drafts(monkeypatch, PROMPTS, reference, 0.2)
    text = ByteTokenizer().decode(reference[0][20:23])
    params = SamplingParams(max_tokens=60, stop_tokens=(), logprobs=True, top_logprobs=3, stop=(text,))

    def completions(speculation: bool) -> list[tuple[str, list[int], list[float]]]:
        engine = make_engine(model, speculation)
        try:
            uids = [engine.submit(None, p, params) for p in PROMPTS]
            done = run_all(engine)
        finally:
            engine.close()
        out = []
        for uid in uids:
            c = done[uid]
            assert c.logprobs is not None
            out.append((c.text, c.token_ids, [lp.logprob for lp in c.logprobs]))
        return out

    plain, drafted = completions(False), completions(True)
    assert len(plain[0][1]) < 30, "the stop string ended the first row"
    for (text_a, tokens_a, lps_a), (text_b, tokens_b, lps_b) in zip(plain, drafted, strict=True):
        assert (text_a, tokens_a) == (text_b, tokens_b)
        assert lps_a == pytest.approx(lps_b, abs=1e-4)


def test_quantized_kv_rows_draft_and_keep_their_greedy_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model("llama", **QUANTIZABLE["llama"])
    params = SamplingParams(max_tokens=50, stop_tokens=())
    quantized = {"kv_bits": 8, "kv_group_size": 32}
    plain, _ = generate(model, False, PROMPTS, params, **quantized)
    oracle_drafts(monkeypatch, PROMPTS, plain, 0.3)
    drafted, engine = generate(model, True, PROMPTS, params, **quantized)
    assert drafted == plain
    assert engine.speculation is not None and engine.speculation.stats.accepted > 0


def test_rows_with_logits_processors_and_state_models_run_plainly(model: object) -> None:
    engine = make_engine(model, True)
    try:
        penalised = engine.submit(None, prompt(20), SamplingParams(max_tokens=4, repetition_penalty=1.3))
        plain = engine.submit(None, prompt(20), SamplingParams(max_tokens=4))
        rows = engine._backend.generator.rows  # type: ignore[attr-defined]
        assert rows[penalised].speculation is None and rows[plain].speculation is not None
        run_all(engine)
    finally:
        engine.close()
    hybrid = BlockPoolBatchEngine(  # SSM state: a trim cannot roll it back
        tiny_model("qwen3_next"),
        ByteTokenizer(),
        model_name="tiny-qwen3-next",
        pool_blocks=64,
        speculation=True,
    )
    try:
        uid = hybrid.submit(None, prompt(20), SamplingParams(max_tokens=4))
        assert hybrid._backend.generator.rows[uid].speculation is None  # type: ignore[attr-defined]
        run_all(hybrid)
    finally:
        hybrid.close()


def test_speculation_follows_its_switch_and_default(model: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVRQ_SPECULATION", raising=False)
    default = BlockPoolBatchEngine(model, ByteTokenizer(), model_name="tiny", pool_blocks=16)
    assert (default.speculation is not None) == SPECULATION_DEFAULT
    default.close()
    monkeypatch.setenv("KVRQ_SPECULATION", "0")
    off = BlockPoolBatchEngine(model, ByteTokenizer(), model_name="tiny", pool_blocks=16)
    monkeypatch.setenv("KVRQ_SPECULATION", "1")
    on = BlockPoolBatchEngine(model, ByteTokenizer(), model_name="tiny", pool_blocks=16)
    assert off.speculation is None and on.speculation is not None
    assert off._backend.generator.speculation is None  # type: ignore[attr-defined]
    off.close()
    on.close()


# ---- the cost policy --------------------------------------------------------------------


class FakeRow:
    def __init__(self, uid: int, tokens: list[int]) -> None:
        self.uid, self.cached_tokens, self.pending = uid, tokens[:-1], tokens[-1:]
        self.max_tokens, self.sampled = 100, [1]


def offer(n_rows: int, acceptance: float = 0.8) -> list[tuple[Any, RowSpeculation]]:
    """Rows whose context ends in a 4-gram seen before: each offers a draft of 4 tokens."""
    return [
        (FakeRow(i, [1, 2, 3, 4, 5, 6] * 4), RowSpeculation(acceptance=acceptance)) for i in range(n_rows)
    ]


def measured(speculation: Speculation, tokens: int, drafted: bool, seconds: float) -> None:
    """A step size timed often enough for the policy to act on it (MIN_SAMPLES)."""
    for _ in range(MIN_SAMPLES):
        speculation.times.record(tokens, drafted, seconds)


def test_the_policy_drafts_where_the_step_is_cheap_and_not_where_draft_tokens_cost_a_rows_share() -> None:
    speculation = Speculation()
    assert speculation.plan(offer(1), 1, step=1, extra_s=0.0) == {}, "a plain step is measured first"
    measured(speculation, 1, False, 0.050)
    measured(speculation, 16, False, 0.200)
    measured(speculation, 5, True, 0.052)  # memory-bound: 4 drafts cost 4% of a step
    assert len(speculation.plan(offer(1), 1, step=2, extra_s=0.0)) == 1
    # compute-bound: each draft token costs what a row's share of the step does
    measured(speculation, 20, True, 0.250)
    assert speculation.plan(offer(16), 16, step=3, extra_s=0.0) == {}


def test_the_policy_reads_the_cpus_staircase_of_step_costs() -> None:
    """A staircase of step costs, as on the CPU (engine/cpu/gemm_rows.py): where a step of 4 rows
    costs what one of 16 tokens does, drafts up to 16 tokens in all cost (almost) nothing, while one
    row's first draft doubles its step: it pays only with drafts likely accepted."""
    speculation = Speculation()
    measured(speculation, 4, False, 0.100)
    measured(speculation, 16, True, 0.102)
    measured(speculation, 20, True, 0.200)
    assert len(speculation.plan(offer(4, acceptance=0.3), 4, step=1, extra_s=0.0)) == 3, (
        "3 drafts of 4 fit in 16 tokens; the 4th would make a step of 20 (32 matmul rows)"
    )
    measured(speculation, 1, False, 0.050)
    measured(speculation, 5, True, 0.100)
    assert len(speculation.plan(offer(1, acceptance=0.8), 1, step=2, extra_s=0.0)) == 1
    assert speculation.plan(offer(1, acceptance=0.3), 1, step=3, extra_s=0.0) == {}


def test_a_step_size_measured_once_is_a_guess_a_draft_more_at_most_tries() -> None:
    """One noisy step must not open the gates: beyond what was timed MIN_SAMPLES times the policy
    adds one row's draft a step, however cheap the guess looks."""
    speculation = Speculation()
    measured(speculation, 16, False, 0.200)
    assert len(speculation.plan(offer(16), 16, step=1, extra_s=0.0)) == 1, "a step of 20: not timed yet"
    speculation.times.record(20, drafted=True, seconds=0.150)  # once, and (noisily) cheap
    assert len(speculation.plan(offer(16), 16, step=2, extra_s=0.0)) == 1
    speculation.times.record(20, drafted=True, seconds=0.150)
    speculation.times.record(20, drafted=True, seconds=0.150)
    assert len(speculation.plan(offer(16), 16, step=3, extra_s=0.0)) == 2, "20 founded: 24 is tried"
    slow = Speculation()
    measured(slow, 1, False, 0.050)
    slow.times.record(5, drafted=True, seconds=0.400)  # one step a neighbour slowed
    assert len(slow.plan(offer(1), 1, step=1, extra_s=0.0)) == 1, "timed again until founded"
    measured(slow, 5, True, 0.400)
    assert slow.plan(offer(1), 1, step=2, extra_s=0.0) == {}
    measured(slow, 16, False, 0.200)
    assert slow.plan(offer(16, acceptance=0.1), 16, step=3, extra_s=0.0) == {}, (
        "16 rows: 0.11 tokens expected of a draft would not pay even free: not tried"
    )


def test_drafts_the_cost_turns_down_are_probed_less_and_less_often() -> None:
    speculation = Speculation()
    measured(speculation, 1, False, 0.050)
    measured(speculation, 5, True, 0.200)
    probes = [step for step in range(1, 240) if speculation.plan(offer(1, acceptance=0.5), 1, step, 0.0)]
    assert probes == [32, 96, 224], "after 32 turned-down steps, then 64, then 128"


def test_draft_tokens_not_timed_yet_are_priced_like_prompt_tokens_and_never_forced() -> None:
    """With StepCost's price of a prompt token, a step size nobody timed is no reason to try a draft:
    a full batch on a compute-bound step (each token a row's share) is priced out at once, while
    where tokens are cheap against the step (one row; a GPU) the drafts go ahead."""
    full = Speculation()
    measured(full, 16, False, 0.200)
    token_s = 0.200 / 16  # compute-bound: a token costs a row's share of the step
    assert full.plan(offer(16), 16, step=1, extra_s=0.0, token_s=token_s) == {}
    assert full.plan(offer(16), 16, step=2, extra_s=0.0) != {}, "without the prior: timed until founded"
    cheap = Speculation()
    measured(cheap, 16, False, 0.200)
    assert len(cheap.plan(offer(16), 16, step=1, extra_s=0.0, token_s=0.0005)) > 1, "GPU-like: many draft"
    one = Speculation()
    measured(one, 1, False, 0.050)
    assert len(one.plan(offer(1), 1, step=1, extra_s=0.0, token_s=0.005)) == 1
    one.times.record(5, drafted=True, seconds=0.200)  # timed once and dear: the prior still rules...
    assert len(one.plan(offer(1), 1, step=2, extra_s=0.0, token_s=0.005)) == 1
    measured(one, 5, True, 0.200)  # ...until founded
    assert one.plan(offer(1), 1, step=3, extra_s=0.0, token_s=0.005) == {}


def test_step_sizes_that_run_as_the_same_rows_share_one_figure() -> None:
    """On the CPU 20 to 31 tokens run as 32 matmul rows: one drafted step of 16 rows + 8 drafts
    founds the figure for 16 + 4 too, so a full batch is not timed again at every draft length."""
    speculation = Speculation(step_rows=lambda n: 32 if 20 <= n <= 31 else n)
    measured(speculation, 16, False, 0.100)
    measured(speculation, 24, True, 0.200)
    assert speculation.times.estimate(20, drafted=True) == (pytest.approx(0.200), True)
    assert speculation.plan(offer(16), 16, step=1, extra_s=0.0) == {}, "a draft doubles the step"


def test_a_drafted_step_is_charged_the_copies_it_leaves_to_the_next_step() -> None:
    """The step after a drafted one carries its rows back into the ShortSlots: its time over a plain
    step's is the draft's cost, not a plain step's."""

    @dataclass
    class Step:
        decode_rows: int
        draft_tokens: int
        step_s: float
        prompt_tokens: int = 0
        accepted_tokens: int = 0

    speculation = Speculation()
    measured(speculation, 4, False, 0.100)
    speculation.record_step(Step(4, 8, 0.110, accepted_tokens=4))
    speculation.record_step(Step(4, 0, 0.150))  # 50 ms of copies back into the slots
    assert speculation.times.drafted[12] == pytest.approx(0.160)
    assert speculation.times.plain[4] == pytest.approx(0.100), "the copies are no plain step's cost"


def test_a_row_whose_drafts_keep_failing_pauses() -> None:
    state = RowSpeculation()
    state.record(4, 0, step=10)
    assert state.paused_until <= 10
    state.record(4, 0, step=11)
    state.record(4, 0, step=12)
    assert state.paused_until > 13 and state.acceptance < 0.2
    state.record(2, 2, step=30)
    assert state.misses == 0


# ---- sampled rows: speculative sampling keeps the distribution ---------------------------


def chi_square(observed: Counter[int], probs: list[float]) -> tuple[float, int]:
    """Pearson's statistic against expected counts (cells under 5 expected merged) and its df."""
    n = sum(observed.values())
    stat, cells, rest_obs, rest_exp = 0.0, 0, 0, 0.0
    for token, p in enumerate(probs):
        if n * p < 5:
            rest_obs, rest_exp = rest_obs + observed[token], rest_exp + n * p
            continue
        stat += (observed[token] - n * p) ** 2 / (n * p)
        cells += 1
    if rest_exp > 0:
        stat += (rest_obs - rest_exp) ** 2 / rest_exp
        cells += 1
    return stat, cells - 1


def generous_bound(df: int) -> float:
    """Far in the tail (about 6 standard deviations of a chi-square with df degrees of freedom)."""
    return df + 6 * math.sqrt(2 * df) + 10


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=4, temperature=1.0, seed=3),
        SamplingParams(max_tokens=4, temperature=0.7, top_k=4, seed=3),
    ],
)
def test_speculative_sampling_draws_each_position_from_the_samplers_distribution(
    params: SamplingParams,
) -> None:
    logits = mx.array(
        [[2.0, 1.0, 0.5, 0.0, -1.0, 0.3], [0.0, 2.5, 1.0, 1.0, 0.2, -0.5], [1.0, 0.0, 0.0, 2.0, 0.5, 0.1]]
    )
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    draws = SampledDraws(params)
    probs: list[list[float]] = draws.probabilities(logprobs).tolist()  # type: ignore[assignment]
    draft = [1, 3]  # not the likeliest first token: rejected often, residual draws exercised
    first: Counter[int] = Counter()
    second: Counter[int] = Counter()
    for _ in range(2000):
        tokens = draws.verify(logprobs, draft)
        first[tokens[0]] += 1
        if tokens[0] == draft[0]:
            second[tokens[1]] += 1
    stat, df = chi_square(first, probs[0])
    assert stat < generous_bound(df), (first, probs[0])
    stat, df = chi_square(second, probs[1])
    assert stat < generous_bound(df), (second, probs[1])
    if params.top_k:
        assert all(probs[0][t] > 0 for t in first), "no token outside the sampler's top_k"


def test_sampled_rows_keep_their_distribution_with_drafts_end_to_end(
    model: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wiring, end to end: hundreds of unseeded rows (a seeded row runs plainly: its seed promises
    the same tokens on every run), each drafting at every step (the second token's likeliest value,
    over and over); the second and third tokens' histograms with and without drafts agree (two-sample
    chi-square, generous bound). It catches a sampled row verified greedily or its draws taken from the
    wrong position; the accept rule's own exactness is the test above's. The rows' random keys come
    from os.urandom, replaced here by a seeded generator so the test draws the same numbers every run."""
    base = prompt(12)

    def histogram(speculation: bool) -> list[Counter[int]]:
        counts: list[Counter[int]] = [Counter(), Counter()]
        keys = random.Random(10_000 if speculation else 0)
        monkeypatch.setattr(os, "urandom", lambda n: keys.getrandbits(8 * n).to_bytes(n, "little"))
        engine = make_engine(model, speculation, max_batch=64, pool_blocks=128)
        try:
            for _ in range(384):
                params = SamplingParams(max_tokens=3, temperature=0.3, stop_tokens=())
                engine.submit(None, base, params)
                if engine.free_slots() == 0:
                    tally(counts, run_all(engine).values())
            tally(counts, run_all(engine).values())
            if engine.speculation is not None:
                assert engine.speculation.stats.proposed > 0
        finally:
            engine.close()
        return counts

    plain = histogram(False)
    ((likeliest, _),) = plain[0].most_common(1)
    monkeypatch.setattr(NgramIndex, "propose", lambda self, k: [likeliest] * k)
    drafted = histogram(True)
    for a, b in zip(plain, drafted, strict=True):
        stat, df = two_sample_chi_square(a, b)
        assert stat < generous_bound(df), (a, b)


def tally(counts: list[Counter[int]], completions: Iterable[Completion]) -> None:
    """The second and third tokens of each completion (-1: it ended before, on the end token)."""
    for c in completions:
        for i, counter in enumerate(counts, start=1):
            counter[c.token_ids[i] if len(c.token_ids) > i else -1] += 1


def two_sample_chi_square(a: Counter[int], b: Counter[int]) -> tuple[float, int]:
    """Homogeneity of two equal-size samples over their tokens (tokens under 10 in all merged)."""
    keys = sorted(set(a) | set(b))
    big = [k for k in keys if a[k] + b[k] >= 10]
    rest = (sum(a[k] for k in keys if k not in big), sum(b[k] for k in keys if k not in big))
    cells = [(a[k], b[k]) for k in big] + ([rest] if sum(rest) else [])
    stat = sum((x - y) ** 2 / (x + y) for x, y in cells if x + y)
    return stat, max(1, len(cells) - 1)
