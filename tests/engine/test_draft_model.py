"""A small draft model as the drafter (engine/batch/drafters.py DraftModel) on tiny random models:
its per-row cache follows the row and is trimmed back after a rejection, greedy tokens are the
same as without speculation whatever the draft model guesses, sampled rows keep their distribution,
the policy runs the draft model only for the rows it picks, and models it cannot draft with are
refused with what to do instead."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import pytest

from engine.batch.drafters import DraftModel, DraftModelRow
from engine.batch.engine import BlockPoolBatchEngine
from engine.batch.speculation import PROBE_EVERY, RowSpeculation, Speculation
from engine.core.params import SamplingParams
from tests.engine.test_ragged import prompt, run_all
from tests.engine.test_speculation import (
    PROMPTS,
    FakeRow,
    generate,
    generous_bound,
    measured,
    tally,
    two_sample_chi_square,
)
from tests.engine.tiny import ByteTokenizer, tiny_model

pytestmark = pytest.mark.mlx_path  # run again with KVRQ_CPU_SHORTCUTS=0 by .ci/test


@pytest.fixture(scope="module")
def model() -> object:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def other_model() -> object:
    """Another random llama of the same vocabulary: its guesses are mostly wrong."""
    return tiny_model("llama", seed=5)


def greedy_continuation(model: Any, context: list[int], n: int) -> list[int]:
    """The model's own greedy tokens after `context`, each from a full forward (no cache)."""
    tokens = list(context)
    for _ in range(n):
        greedy: int = mx.argmax(model(mx.array(tokens)[None])[0, -1]).item()  # type: ignore[assignment]
        tokens.append(greedy)
    return tokens[len(context) :]


def test_a_rows_draft_is_the_draft_models_greedy_continuation_after_trims_and_catch_up(model: Any) -> None:
    row = DraftModelRow(model)
    context = prompt(700, salt=3)  # more than one catch-up chunk
    assert row.draft(context, 4) == greedy_continuation(model, context, 4)
    # Two of the four accepted, then the target's own token: the cache is trimmed back to the context.
    context = [*context, *row.tokens[len(context) :][:2], 77]
    assert row.draft(context, 3) == greedy_continuation(model, context, 3)
    assert row.tokens[: len(context)] == context
    # Everything accepted and more decoded since: the cache only reads what it lacks.
    context = [*row.tokens, 9, 9, 9, 12]
    assert row.draft(context, 2) == greedy_continuation(model, context, 2)


def test_greedy_tokens_are_the_same_with_a_draft_model_that_guesses_wrong(
    model: object, other_model: object
) -> None:
    params = SamplingParams(max_tokens=60, stop_tokens=())
    plain, _ = generate(model, False, PROMPTS, params)
    drafted, engine = generate(model, True, PROMPTS, params, draft_model=other_model)
    assert drafted == plain
    stats = engine.speculation.stats  # type: ignore[union-attr]
    assert stats.proposed > 100 and stats.accepted < stats.proposed, "drafts were verified and rejected"


def test_the_model_as_its_own_draft_model_has_every_greedy_draft_accepted(model: object) -> None:
    params = SamplingParams(max_tokens=40, stop_tokens=())
    plain, _ = generate(model, False, PROMPTS, params)
    drafted, engine = generate(model, True, PROMPTS, params, draft_model=model)
    assert drafted == plain
    stats = engine.speculation.stats  # type: ignore[union-attr]
    assert stats.proposed > 50 and stats.accepted == stats.proposed


def test_sampled_rows_keep_their_distribution_with_a_draft_model(model: object) -> None:
    """Speculative sampling with a draft model's deterministic guesses (the model itself as the draft
    model: its argmax, accepted often, rejected where the sampler draws another token): the second
    and third tokens' histograms with and without drafts agree (two-sample chi-square)."""
    base = prompt(12)

    def histogram(draft_model: object | None) -> list[Counter[int]]:
        counts: list[Counter[int]] = [Counter(), Counter()]
        engine = BlockPoolBatchEngine(
            model,
            ByteTokenizer(),
            model_name="tiny-llama",
            pool_blocks=128,
            max_batch=32,
            speculation=draft_model is not None,
            draft_model=draft_model,
        )
        if engine.speculation is not None:
            engine.speculation.always = True
        try:
            for _ in range(256):
                engine.submit(None, base, SamplingParams(max_tokens=3, temperature=0.5, stop_tokens=()))
                if engine.free_slots() == 0:
                    tally(counts, run_all(engine).values())
            tally(counts, run_all(engine).values())
            if engine.speculation is not None:
                stats = engine.speculation.stats
                assert 0 < stats.accepted < stats.proposed
        finally:
            engine.close()
        return counts

    for a, b in zip(histogram(None), histogram(model), strict=True):
        stat, df = two_sample_chi_square(a, b)
        assert stat < generous_bound(df), (a, b)


@dataclass
class ModelDrafter:
    """A Drafter that runs a model, at these prices timed when it was made."""

    token_s: float = 0.0
    prompt_token_s: float = 0.0
    runs_a_model: bool = True

    def for_row(self) -> CountingDrafter:
        return CountingDrafter(self.token_s)


COSTLY = ModelDrafter()  # prices not known up front: the policy learns them from the rows' drafts


class CountingDrafter:
    def __init__(self, token_s: float = 0.0, behind: int = 0) -> None:
        self.calls = 0
        self.token_s = token_s  # what each guessed token "took"
        self.lag = behind

    def behind(self, n_context: int) -> int:
        return self.lag

    def draft(self, context: Any, k: int) -> list[int]:
        self.calls += 1
        return [7] * k


def test_the_policy_runs_the_draft_model_only_for_the_rows_it_picks() -> None:
    speculation = Speculation(drafter=COSTLY)
    drafters = [CountingDrafter() for _ in range(4)]
    candidates: list[tuple[Any, RowSpeculation]] = [
        (FakeRow(i, prompt(30)), RowSpeculation(acceptance=0.8, drafter=d)) for i, d in enumerate(drafters)
    ]
    measured(speculation, 4, False, 0.050)
    measured(speculation, 8, True, 0.400)  # drafts cost far more than they return here
    assert speculation.plan(candidates, 4, step=1, extra_s=0.0) == {}
    assert sum(d.calls for d in drafters) == 0, "no forward for a draft the cost turned down"
    measured(speculation, 8, True, 0.051)  # now nearly free: each row drafts
    measured(speculation, 12, True, 0.052)
    measured(speculation, 16, True, 0.053)
    measured(speculation, 20, True, 0.054)
    plan = speculation.plan(candidates, 4, step=2, extra_s=0.0)
    assert plan and all(draft == [7] * 4 for draft in plan.values())
    assert [d.calls for d in drafters] == [1 if i in plan else 0 for i in range(4)]


def test_a_draft_model_slower_than_its_drafts_pay_for_is_not_run_again() -> None:
    """Draft tokens are priced at a prompt token's cost plus the draft model's own time per token:
    once a draft shows the model takes 0.2 s a token against a 50 ms step, the cost turns it down
    (until a probe, PROBE_EVERY steps later)."""
    speculation = Speculation(drafter=COSTLY)
    slow = CountingDrafter(token_s=0.2)
    candidates: list[tuple[Any, RowSpeculation]] = [(FakeRow(0, prompt(30)), RowSpeculation(drafter=slow))]
    measured(speculation, 1, False, 0.050)
    assert speculation.plan(candidates, 1, step=1, extra_s=0.0, token_s=0.001), "tried once: nothing known"
    assert slow.calls == 1 and speculation.draft_token_s == 0.2
    for step in range(2, 1 + PROBE_EVERY // 2):  # 2 calls a step: fewer turned down than a probe waits for
        assert speculation.plan(candidates, 1, step=step, extra_s=0.0, token_s=0.001) == {}
        assert speculation.plan(candidates, 1, step=step, extra_s=0.0, token_s=None) == {}, "no StepCost yet"
    assert slow.calls == 1


def test_a_draft_model_timed_slower_than_it_pays_for_is_never_run() -> None:
    """A draft model is timed when it is made (a Q4 model on the CPU guesses a token slower than the
    fp32 model it drafts for decodes one): its drafts are priced out before any row runs it, and
    probes wait until its work is a small share of the steps since (PROBE_SHARE)."""
    speculation = Speculation(drafter=ModelDrafter(token_s=0.2, prompt_token_s=0.05))
    slow = CountingDrafter()
    candidates: list[tuple[Any, RowSpeculation]] = [(FakeRow(0, prompt(30)), RowSpeculation(drafter=slow))]
    measured(speculation, 1, False, 0.050)
    for step in range(1, 4 * PROBE_EVERY):
        assert speculation.plan(candidates, 1, step=step, extra_s=0.0, token_s=0.001) == {}
    assert slow.calls == 0, "nor probed: its 4 guesses (0.8 s) are more than a tenth of 127 steps of 50 ms"


def test_a_rows_catch_up_is_charged_in_shares_to_its_next_drafts() -> None:
    """A draft model reads a row's context once before its first draft: 100 tokens at 1 ms, spread
    over the drafts of the row's 99 tokens left, is a share of nothing; 50,000 (50 s) is more than a
    draft returns in a 50 ms step."""
    speculation = Speculation(drafter=ModelDrafter(token_s=0.0001, prompt_token_s=0.001))
    measured(speculation, 1, False, 0.050)
    near, far = CountingDrafter(behind=100), CountingDrafter(behind=50_000)
    assert speculation.plan([(FakeRow(0, prompt(30)), RowSpeculation(drafter=near))], 1, 1, 0.0, 0.001)
    assert not speculation.plan([(FakeRow(1, prompt(30)), RowSpeculation(drafter=far))], 1, 2, 0.0, 0.001)
    assert far.calls == 0


def test_a_draft_model_is_timed_when_it_is_made(model: object) -> None:
    drafter = DraftModel(model, vocab_size=256)
    assert drafter.token_s > 0 and drafter.prompt_token_s > 0
    assert drafter.runs_a_model


def test_draft_models_that_cannot_draft_are_refused_with_what_to_do(model: object) -> None:
    with pytest.raises(ValueError, match="share the model's tokenizer"):
        DraftModel(tiny_model("llama", vocab_size=300), vocab_size=256)
    with pytest.raises(ValueError, match="needs full attention"):
        DraftModel(tiny_model("gemma3_text"), vocab_size=256)
    with pytest.raises(ValueError, match="needs the ragged batch"):
        BlockPoolBatchEngine(
            model, ByteTokenizer(), model_name="tiny", pool_blocks=16, ragged=False, draft_model=model
        )


def test_a_draft_model_turns_speculation_on_unless_it_is_turned_off(
    model: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVRQ_SPECULATION", "0")
    on = BlockPoolBatchEngine(model, ByteTokenizer(), model_name="tiny", pool_blocks=16, draft_model=model)
    off = BlockPoolBatchEngine(
        model, ByteTokenizer(), model_name="tiny", pool_blocks=16, draft_model=model, speculation=False
    )
    try:
        assert on.speculation is not None and on.speculation.drafts_cost_forwards
        assert off.speculation is None
    finally:
        on.close()
        off.close()
