"""The step's CPU shortcuts are sized to the step: one or two short rows keep MLX's fused calls."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.core.params import SamplingParams
from engine.cpu import numpy_exp
from engine.cpu.shortcuts import SMALL_STEP_SCORES, SMALL_STEP_TOKENS, CpuShortcuts
from tests.engine.test_ragged import make_engine, prompt
from tests.engine.tiny import tiny_model

ALL_ON = CpuShortcuts(numpy_exp=True, pad_rows=True, native_attention=True)


def test_a_small_step_turns_the_exp_and_attention_shortcuts_off_and_keeps_padding() -> None:
    small = ALL_ON.sized_for(SMALL_STEP_TOKENS - 1, SMALL_STEP_SCORES - 1)
    assert small == CpuShortcuts(numpy_exp=False, pad_rows=True, native_attention=False)
    assert ALL_ON.sized_for(SMALL_STEP_TOKENS, 10) == ALL_ON, "enough rows"
    assert ALL_ON.sized_for(1, SMALL_STEP_SCORES) == ALL_ON, "one row over a long history"
    off = replace(ALL_ON, numpy_exp=False, native_attention=False)
    assert off.sized_for(100, 10**6) == off, "an opt-out stays out"


def test_decode_steps_of_one_short_row_take_mlx_s_calls_and_a_long_one_numpy_s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    swiglus: list[int] = []
    real = numpy_exp.numpy_swiglu
    monkeypatch.setattr(numpy_exp, "numpy_swiglu", lambda g, x: swiglus.append(g.shape[0]) or real(g, x))
    engine = make_engine(tiny_model("llama"), prefill_tokens_per_step=2048)
    engine.submit(None, prompt(30), SamplingParams(max_tokens=3, stop_tokens=()), keep_cache=False)
    engine.step()  # the prompt: 30 tokens, numpy's
    assert swiglus, "a prefill step is not small"
    swiglus.clear()
    engine.step()  # one row decoding over 31 keys
    assert swiglus == [], "one short decoding row: MLX's fused calls"
    engine.step()
    engine.submit(None, prompt(SMALL_STEP_SCORES + 10, salt=1), SamplingParams(max_tokens=3, stop_tokens=()))
    engine.step()  # its prompt
    swiglus.clear()
    engine.step()  # one row decoding over more than SMALL_STEP_SCORES keys
    assert swiglus, "one row over a long history: numpy's and C's"
    engine.close()
