"""Issue 42: a short prompt is never held behind a long prefill. Chunked prefill shares each step, shortest
remaining prompt first, so a prompt of up to the step's budget gets its first token within two steps of
its submit wherever in the long prefill it arrives (in the first, unless the long one finishes first),
and the long prompt keeps advancing. Counted in steps, on the tiny model (no timing)."""

from __future__ import annotations

import pytest

from engine.batch.step_cost import StepCost
from engine.core.params import SamplingParams
from tests.engine.test_ragged import GREEDY_LONG, make_engine, prompt, tokens_of
from tests.engine.tiny import tiny_model

pytestmark = pytest.mark.mlx_path

BUDGET = 64  # prompt tokens a step (the worker's 256, scaled to the tiny model's tests)


@pytest.mark.parametrize("learnt_cost", [False, True], ids=["no cost yet", "a cost that splits bursts"])
def test_a_short_prompt_arriving_at_any_step_of_a_long_prefill_gets_its_first_token_within_two_steps(
    monkeypatch: pytest.MonkeyPatch, learnt_cost: bool
) -> None:
    model = tiny_model("llama")
    long_tokens, short_tokens = 14 * BUDGET + 5, 50  # 200 of 256, scaled
    waits = []
    for arrival in range(1, 17):  # every step of the long prefill (the mate decoding), and just after it
        engine = make_engine(model, prefill_tokens_per_step=BUDGET)
        try:
            generator = engine._backend.generator  # type: ignore[attr-defined]
            cost = StepCost()
            if learnt_cost:  # J for one 50-token prompt: 23 tokens a step (step_cost.py)
                cost.fixed_s, cost.per_token_s = 0.01, 0.001
            monkeypatch.setattr(cost, "record", lambda step: None)
            generator.cost = cost
            mate = engine.submit(None, prompt(10), GREEDY_LONG, keep_cache=False)
            long = engine.submit(None, prompt(long_tokens, salt=1), GREEDY_LONG, keep_cache=False)
            for _ in range(arrival):
                engine.step()
            short = engine.submit(
                None,
                prompt(short_tokens, salt=2),
                SamplingParams(max_tokens=2, stop_tokens=()),
                keep_cache=False,
            )
            long_left = len(generator.rows[long].pending)
            for step in range(1, 4):
                out = tokens_of(engine.step())
                if step == 1:
                    carried = generator.last_step.prompt_tokens
                if short in out:
                    break
            else:
                raise AssertionError(f"arriving at step {arrival}: no first token in 3 steps")
            assert mate in out, "the decoding row got its token in that step too"
            if long_left > short_tokens:
                assert step == 1, f"arriving at step {arrival}: the shortest waiting prompt goes first"
                assert carried == BUDGET, "the long prompt went on in the rest of that step's budget"
            waits.append(step)
        finally:
            engine.close()
    assert max(waits) <= 2
