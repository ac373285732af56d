"""The ragged step's attention: numpy's softmax on the CPU equals MLX's fused call up to rounding."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from engine.batch import acceleration
from engine.batch.attention import AttentionCall
from engine.cpu.shortcuts import cpu_shortcuts, in_ragged_step

SCALE = 0.125


def fused(call: AttentionCall, sinks: mx.array | None = None) -> mx.array:
    return mx.fast.scaled_dot_product_attention(
        call.queries, call.keys, call.values, scale=SCALE, mask=call.mask, sinks=sinks
    )


def attend(
    calls: list[AttentionCall], scale: float, sinks: mx.array | None, native: bool = False
) -> list[mx.array]:
    """As the ragged step calls it: inside its forward pass (decoding rows in C if `native`,
    else in the split path this module tests; tests/engine/test_native_attention.py tests C)."""
    with in_ragged_step(replace(cpu_shortcuts(), native_attention=native)):
        return acceleration.attend(calls, scale, sinks)


def random_call(batch: int, heads: int, kv_heads: int, queries: int, keys: int, mask: Any) -> AttentionCall:
    mx.random.seed(batch * 1000 + queries + keys)
    return AttentionCall(
        mx.random.normal((batch, heads, queries, 64)),
        mx.random.normal((batch, kv_heads, keys, 64)),
        mx.random.normal((batch, kv_heads, keys, 48)),  # value dim may differ from the key dim
        mask,
    )


def keep_mask(lengths: list[int], width: int) -> mx.array:
    return (mx.arange(width)[None, :] < mx.array(lengths)[:, None])[:, None, None, :]


CASES = {
    "suffix over history (GQA, causal)": lambda: random_call(1, 9, 3, 17, 1024, "causal"),
    "prefill chunk from the start": lambda: random_call(1, 4, 2, 64, 64, "causal"),
    "one decoding token": lambda: random_call(1, 9, 3, 1, 700, None),
    "slotted rows of several lengths": lambda: random_call(5, 9, 3, 1, 40, keep_mask([40, 1, 7, 39, 20], 40)),
    "no GQA": lambda: random_call(1, 4, 4, 5, 9, "causal"),
}


@pytest.mark.parametrize("case", CASES)
def test_numpy_softmax_equals_the_fused_call(case: str) -> None:
    call = CASES[case]()
    (got,) = attend([call], SCALE, None)
    want = fused(call)
    assert got.shape == want.shape
    np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-6, rtol=1e-5)


def test_one_layer_of_calls_comes_back_in_order() -> None:
    calls = [CASES[case]() for case in CASES]
    outputs = attend(calls, SCALE, None)
    for call, got in zip(calls, outputs, strict=True):
        np.testing.assert_allclose(np.array(got), np.array(fused(call)), atol=2e-6, rtol=1e-5)


def test_inputs_are_untouched_by_the_in_place_softmax() -> None:
    call = CASES["suffix over history (GQA, causal)"]()
    before = [np.array(a) for a in (call.queries, call.keys, call.values)]
    attend([call], SCALE, None)
    for original, now in zip(before, (call.queries, call.keys, call.values), strict=True):
        assert np.array_equal(original, np.array(now))


def test_on_the_cpu_the_fused_call_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> mx.array:
        raise AssertionError("the fused call ran")

    call = CASES["one decoding token"]()
    want = fused(call)
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", refuse)
    (got,) = attend([call], SCALE, None)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("why", ["switched off", "attention sinks", "float16"])
def test_fused_call_where_numpy_softmax_does_not_apply(why: str, monkeypatch: pytest.MonkeyPatch) -> None:
    call = CASES["suffix over history (GQA, causal)"]()
    sinks = None
    if why == "switched off":
        monkeypatch.setenv("KVRQ_NUMPY_EXP", "0")
    elif why == "attention sinks":
        sinks = mx.zeros((9,))
    else:
        halves = (a.astype(mx.float16) for a in (call.queries, call.keys, call.values))
        call = AttentionCall(*halves, call.mask)
    (got,) = attend([call], SCALE, sinks)
    assert np.array_equal(np.array(got.astype(mx.float32)), np.array(fused(call, sinks).astype(mx.float32)))
