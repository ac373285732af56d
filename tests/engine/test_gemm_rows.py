"""The CPU step's matmuls run 16-row multiples: the padding changes no token, K/V or position."""

from __future__ import annotations

import pytest

from engine.core.params import SamplingParams
from engine.cpu import numpy_exp
from engine.cpu.gemm_rows import padded_rows
from engine.cpu.shortcuts import cpu_shortcuts
from tests.engine.test_ragged import make_engine, prompt, run_all, saved_cache
from tests.engine.tiny import tiny_model


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        (1, 1),
        (3, 3),
        (4, 4),
        (9, 9),
        (10, 16),
        (12, 16),
        (16, 16),
        (17, 17),
        (19, 19),
        (20, 32),
        (31, 32),
        (32, 32),
        (268, 268),
    ],
)
def test_rows_are_padded_where_the_cpu_matmul_measured_faster(rows: int, expected: int) -> None:
    assert padded_rows(rows) == expected
    assert padded_rows(rows, on=False) == rows


def test_the_padding_is_switched_off_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVRQ_PAD_ROWS", "0")
    assert not cpu_shortcuts().pad_rows


def run_mixed_batch(monkeypatch: pytest.MonkeyPatch, pad: str) -> tuple[list[list[int]], list[int]]:
    """Five rows of several lengths (one resumed from a cache, one long) to the end; (each
    row's tokens, the row counts the steps' MLPs saw)."""
    monkeypatch.setenv("KVRQ_PAD_ROWS", pad)
    model = tiny_model("llama")
    engine = make_engine(model, prefill_tokens_per_step=64)
    cache = saved_cache(engine, 90)
    seen: list[int] = []
    real = numpy_exp.numpy_swiglu
    monkeypatch.setattr(numpy_exp, "numpy_swiglu", lambda g, x: seen.append(g.shape[0]) or real(g, x))
    params = SamplingParams(max_tokens=12, stop_tokens=())
    uids = [engine.submit(None, prompt(n, salt=n), params) for n in (5, 9, 30, 700)]
    uids.append(engine.submit("agent", cache.token_ids + prompt(4, salt=1), params, cache=cache))
    done = run_all(engine)
    engine.close()
    return [done[uid].token_ids for uid in uids], seen


def test_padded_steps_generate_the_same_tokens_as_unpadded_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    padded, padded_rows_seen = run_mixed_batch(monkeypatch, "1")
    plain, plain_rows_seen = run_mixed_batch(monkeypatch, "0")
    assert padded == plain
    if cpu_shortcuts().pad_rows:  # the CPU device: the steps really ran padded
        assert 5 in plain_rows_seen and 5 not in padded_rows_seen
        assert all(padded_rows(n) == n for n in padded_rows_seen), "every step ran at a padded count"
