"""Issue 43: a decode step of a few short rows runs on MLX's fused calls, not the CPU shortcuts' split
(a sync per layer): 4 short rows decoding with the split gave 0.76x raw mlx-lm's throughput."""

from __future__ import annotations

from typing import Any

import pytest

from engine.core.params import SamplingParams
from engine.cpu import numpy_exp
from engine.cpu.shortcuts import CpuShortcuts
from tests.engine.test_ragged import make_engine, prompt
from tests.engine.tiny import tiny_model

ALL_ON = CpuShortcuts(numpy_exp=True, pad_rows=True, native_attention=True)


@pytest.mark.parametrize("rows", [4, 7])
def test_a_few_short_rows_decoding_keep_mlx_s_fused_calls(rows: int) -> None:
    assert ALL_ON.sized_for(rows, rows * 100) == CpuShortcuts(
        numpy_exp=False, pad_rows=True, native_attention=False
    )


def test_eight_rows_or_long_histories_take_the_split() -> None:
    assert ALL_ON.sized_for(8, 8 * 30) == ALL_ON, "eight rows"
    assert ALL_ON.sized_for(4, 4 * 600) == ALL_ON, "4 rows of 600 keys: the split won 1.19-1.30x"


def test_a_decode_step_of_four_short_rows_runs_mlx_s_swiglu(monkeypatch: pytest.MonkeyPatch) -> None:
    swiglus: list[int] = []
    real = numpy_exp.numpy_swiglu

    def counting(gate: Any, x: Any) -> Any:
        swiglus.append(gate.shape[0])
        return real(gate, x)

    monkeypatch.setattr(numpy_exp, "numpy_swiglu", counting)
    engine = make_engine(tiny_model("llama"), prefill_tokens_per_step=2048)
    try:
        for i in range(4):
            engine.submit(
                None, prompt(30, salt=i), SamplingParams(max_tokens=3, stop_tokens=()), keep_cache=False
            )
        engine.step()  # the four prompts: 120 tokens, numpy's
        assert swiglus, "a prefill step is not small"
        swiglus.clear()
        engine.step()  # four rows decoding over 31 keys each
        assert swiglus == [], "four short decoding rows: MLX's fused calls"
    finally:
        engine.close()
