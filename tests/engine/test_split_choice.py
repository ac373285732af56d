"""SplitChoice (engine/batch/split_choice.py): a decode step shape runs the CPU shortcuts' split or
MLX's fused calls, whichever its own steps' times say is faster, and keeps re-trying the other."""

from __future__ import annotations

import pytest

from engine.batch import split_choice
from engine.batch.split_choice import EXPLORE_AFTER, EXPLORE_EVERY, SplitChoice
from engine.core.params import SamplingParams
from engine.cpu.shortcuts import CpuShortcuts
from tests.engine.test_ragged import make_engine, prompt, run_all
from tests.engine.tiny import tiny_model

SPLIT = CpuShortcuts(numpy_exp=True, pad_rows=True, native_attention=True)
FUSED = SPLIT.fused()
KEY = (16, 11)


def run(choice: SplitChoice, steps: int, split_s: float, fused_s: float) -> list[bool]:
    """The way each step ran (True: split), each timed as given."""
    ways = []
    for _ in range(steps):
        shortcuts, split = choice.pick(KEY, SPLIT, FUSED)
        assert split is not None and shortcuts == (SPLIT if split else FUSED)
        choice.record(KEY, split, split_s if split else fused_s)
        ways.append(split)
    return ways


def test_nothing_to_choose_where_nothing_is_split() -> None:
    choice = SplitChoice()
    assert choice.pick(KEY, FUSED, FUSED.fused()) == (FUSED, None)
    assert choice.pick(KEY, None, None) == (None, None), "no CPU package, or Metal / CUDA"


def test_the_split_runs_first_then_the_faster_way_with_the_other_retried() -> None:
    choice = SplitChoice()
    ways = run(choice, EXPLORE_AFTER, split_s=0.2, fused_s=0.1)
    assert all(ways), "the thresholds' choice until the shape has run a while"
    ways = run(choice, 5, split_s=0.2, fused_s=0.1)
    assert ways == [False, True, False, True, False], "fused every other step until it has its samples"
    ways = run(choice, 2 * EXPLORE_EVERY, split_s=0.2, fused_s=0.1)
    assert ways.count(True) == 2, "fused is faster: the split re-tried one step in EXPLORE_EVERY"
    assert choice.fused_steps > 60


def test_a_faster_split_keeps_running() -> None:
    choice = SplitChoice()
    run(choice, EXPLORE_AFTER + 5, split_s=0.1, fused_s=0.2)
    ways = run(choice, 2 * EXPLORE_EVERY, split_s=0.1, fused_s=0.2)
    assert ways.count(False) == 2


def test_greedy_tokens_are_the_same_whichever_way_each_step_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight rows decoding on the tiny llama (a step the thresholds split), the choice switching
    between split and fused steps from the start: the tokens are those of the split alone. Speculation
    is off: a drafted step is never switched, and whether a step drafts is the measured cost's call, so
    on a loaded machine most steps drafted and only one ran fused (CI, 2026-11-28)."""
    model = tiny_model("llama")
    prompts = [prompt(60 + 7 * i, salt=i) for i in range(8)]
    params = SamplingParams(max_tokens=40, stop_tokens=())

    def tokens() -> tuple[list[list[int]], int]:
        engine = make_engine(model, speculation=False)
        try:
            uids = [engine.submit(None, p, params) for p in prompts]
            done = run_all(engine)
            fused = engine._backend.generator.split_choice.fused_steps  # type: ignore[attr-defined]
        finally:
            engine.close()
        return [done[uid].token_ids for uid in uids], fused

    monkeypatch.setattr(split_choice, "EXPLORE_AFTER", 10**6)
    split_only, fused = tokens()
    assert fused == 0
    monkeypatch.setattr(split_choice, "EXPLORE_AFTER", 0)
    monkeypatch.setattr(split_choice, "EXPLORE_EVERY", 2)
    mixed, fused = tokens()
    assert fused > 5 and mixed == split_only
