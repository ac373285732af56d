"""StepCost: the step's cost learnt from the steps run, and the finishing tokens a step carries;
on the ragged batch, a burst of warm joiners split over steps, shortest first, tokens unchanged."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from engine.batch.engine import BlockPoolBatchEngine
from engine.batch.step_cost import MEDIAN_SLACK, StepCost
from engine.core.params import SamplingParams
from tests.engine.test_ragged import make_engine, prompt, run_all, saved_cache, tokens_of
from tests.engine.tiny import tiny_model

pytestmark = pytest.mark.mlx_path


@dataclass
class Step:
    prompt_tokens: int
    decode_rows: int
    forward_s: float


def test_no_bound_until_both_parts_of_the_cost_are_known() -> None:
    cost = StepCost()
    assert cost.join_tokens([20] * 10) is None
    cost.record(Step(prompt_tokens=100, decode_rows=0, forward_s=0.5))  # no fixed part yet to take off
    assert cost.join_tokens([20] * 10) is None
    cost.record(Step(prompt_tokens=0, decode_rows=8, forward_s=0.06))
    assert cost.join_tokens([20] * 10) is None


def test_a_token_is_priced_from_prompt_only_steps_until_its_cost_on_top_of_decoding_is_known() -> None:
    """Speculation prices draft tokens not timed yet with it (engine/batch/speculation.py): a fresh
    engine given all its prompts at once runs prompt-only steps before any mixed one."""
    cost = StepCost()
    assert cost.token_price_s is None
    cost.record(Step(prompt_tokens=200, decode_rows=0, forward_s=1.0))
    assert cost.token_price_s == pytest.approx(0.005)  # errs high: the fixed part is in it
    cost.record(Step(prompt_tokens=0, decode_rows=8, forward_s=0.06))
    cost.record(Step(prompt_tokens=100, decode_rows=8, forward_s=0.46))
    assert cost.token_price_s == pytest.approx(0.004) == cost.per_token_s


def test_the_bound_is_the_square_root_of_fixed_over_per_token_times_what_waits() -> None:
    cost = StepCost()
    cost.record(Step(prompt_tokens=0, decode_rows=8, forward_s=0.06))
    cost.record(Step(prompt_tokens=100, decode_rows=8, forward_s=0.06 + 100 * 0.0045))
    assert cost.fixed_s == pytest.approx(0.06) and cost.per_token_s == pytest.approx(0.0045)
    # 57: ~3 suffixes of 20; the median's 7 (140 tokens) would cost the mean 14% (over MEDIAN_SLACK)
    assert cost.join_tokens([20] * 12) == math.ceil(math.sqrt(0.06 * 240 / 0.0045))
    cost.record(Step(prompt_tokens=8, decode_rows=8, forward_s=9.0))  # too few tokens to count
    assert cost.per_token_s == pytest.approx(0.0045)


def test_cheap_prompt_tokens_leave_the_whole_burst_in_one_step() -> None:
    """A fixed part worth 300 prompt tokens (a GPU's): the bound is above a 240-token burst."""
    cost = StepCost()
    cost.record(Step(prompt_tokens=0, decode_rows=8, forward_s=0.015))
    cost.record(Step(prompt_tokens=200, decode_rows=8, forward_s=0.015 + 200 * 0.00005))
    assert (cost.join_tokens([20] * 12) or 0) >= 240


def test_the_first_step_finishes_the_medians_half_where_the_mean_barely_moves() -> None:
    """Twelve agents returning at once on the 2-core CPU (suffixes and costs measured there): the
    mean's least J is 4 suffixes, so the median agent waited for a second step; the shortest 7 (its
    first step) cost the mean under MEDIAN_SLACK more."""
    cost = StepCost()
    cost.fixed_s, cost.per_token_s = 0.04, 0.0019
    suffixes = [26, 18, 19, 22, 19, 25, 19, 22, 18, 22, 23, 19]
    least = math.ceil(math.sqrt(0.04 * sum(suffixes) / 0.0019))
    assert least == 73
    half = sum(sorted(suffixes)[:7])
    assert cost.join_tokens(suffixes) == half == 134
    slower = cost.mean_first_token_s(half, sum(suffixes)) / cost.mean_first_token_s(least, sum(suffixes))
    assert 1 < slower <= 1 + MEDIAN_SLACK


def test_a_burst_too_large_for_its_half_in_one_step_keeps_the_means_bound() -> None:
    """A hundred agents at once: half of them in the first step would cost the mean ~25%."""
    cost = StepCost()
    cost.fixed_s, cost.per_token_s = 0.04, 0.0019
    assert cost.join_tokens([20] * 100) == math.ceil(math.sqrt(0.04 * 2000 / 0.0019))  # 206


def first_token_steps(engine: BlockPoolBatchEngine, uids: list[int]) -> tuple[list[int], list[list[int]]]:
    """The step each row's first token came in, and each row's tokens (in the order of `uids`)."""
    first: dict[int, int] = {}
    step = 0
    while len(first) < len(uids):
        step += 1
        for uid in tokens_of(engine.step()) & set(uids):
            first.setdefault(uid, step)
    done = run_all(engine)
    return [first[uid] for uid in uids], [done[uid].token_ids for uid in uids]


def test_a_burst_of_warm_joiners_is_split_shortest_first_without_changing_a_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = tiny_model("llama")
    suffixes = [17, 5, 13, 9]
    results = []
    for split in (False, True):
        engine = make_engine(model)
        try:
            caches = [saved_cache(engine, 100 + 20 * i) for i in range(len(suffixes))]
            generator = engine._backend.generator  # type: ignore[attr-defined]
            cost = StepCost()
            if split:  # a step's fixed part worth ~10 prompt tokens for 44 waiting: the shortest 3, then 1
                cost.fixed_s, cost.per_token_s = 0.01, 0.001
            monkeypatch.setattr(cost, "record", lambda step: None)
            generator.cost = cost
            params = SamplingParams(max_tokens=6, stop_tokens=())
            uids = [
                engine.submit(f"a{i}", c.token_ids + prompt(n, salt=i), params, cache=c)
                for i, (c, n) in enumerate(zip(caches, suffixes, strict=True))
            ]
            results.append(first_token_steps(engine, uids))
        finally:
            engine.close()
    (together, tokens_together), (split_steps, tokens_split) = results
    assert set(together) == {1}, "without a known cost: all four in one step"
    by_length = [step for _, step in sorted(zip(suffixes, split_steps, strict=True))]
    assert by_length == sorted(by_length) and by_length[-1] > 1, "shortest first, over several steps"
    assert by_length[0] == 1
    assert tokens_split == tokens_together, "the same tokens either way"


def test_the_ragged_batch_learns_both_parts_of_its_step_cost() -> None:
    engine = make_engine(tiny_model("llama"))
    try:
        params = SamplingParams(max_tokens=4, stop_tokens=())
        engine.submit(None, prompt(40), params, keep_cache=False)
        run_all(engine)  # a prompt step (before any decode step: not counted), then decode steps
        engine.submit(None, prompt(40, salt=1), params, keep_cache=False)
        run_all(engine)
        cost = engine._backend.generator.cost  # type: ignore[attr-defined]
        assert cost.fixed_s is not None and cost.fixed_s > 0
        assert cost.per_token_s is not None, "the second prompt's step taught the per-token part"
    finally:
        engine.close()
