"""numpy's exp in the ragged step's SwiGLU: same values as mlx-lm's, only inside the ragged step."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama
from mlx_lm.models.activations import swiglu as mlx_lm_swiglu

from engine.batch.engine import BlockPoolBatchEngine
from engine.core.params import SamplingParams
from engine.cpu import numpy_exp
from engine.cpu.gemm_rows import padded_rows
from engine.cpu.shortcuts import cpu_shortcuts, in_ragged_step
from tests.engine.tiny import ByteTokenizer, tiny_model


def test_numpy_swiglu_equals_mlx_lms_including_saturated_gates() -> None:
    mx.random.seed(3)
    gate = mx.concatenate(
        [mx.random.normal((4, 1, 96)) * 4, mx.array([[[-200.0, -90.0, 90.0, 200.0]]] * 4)], axis=-1
    )
    x = mx.random.normal(gate.shape)
    got = np.array(numpy_exp.numpy_swiglu(gate, x))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, np.array(mlx_lm_swiglu(gate, x)), rtol=1e-5, atol=1e-6)


def test_the_routed_swiglu_uses_numpy_inside_the_ragged_step_only(monkeypatch: pytest.MonkeyPatch) -> None:
    numpy_exp.route_swiglu(llama)
    calls: list[int] = []
    real = numpy_exp.numpy_swiglu
    monkeypatch.setattr(numpy_exp, "numpy_swiglu", lambda g, x: calls.append(1) or real(g, x))
    gate, x = mx.ones((2, 1, 8)), mx.ones((2, 1, 8))
    llama.swiglu(gate, x)
    assert calls == [], "outside the ragged step: mlx-lm's own"
    with in_ragged_step(cpu_shortcuts()):
        llama.swiglu(gate, x)
    assert calls == [1]
    monkeypatch.setenv("KVRQ_NUMPY_EXP", "0")
    with in_ragged_step(cpu_shortcuts()):
        llama.swiglu(gate, x)
    assert calls == [1], "switched off"


def test_every_layer_of_a_ragged_step_takes_numpy_s_swiglu(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model("llama")
    engine = BlockPoolBatchEngine(
        model, ByteTokenizer(), model_name="tiny-llama", pool_blocks=16, max_batch=4, max_context=1024
    )  # type: ignore[arg-type]
    calls: list[int] = []
    real = numpy_exp.numpy_swiglu
    monkeypatch.setattr(numpy_exp, "numpy_swiglu", lambda g, x: calls.append(g.shape[0]) or real(g, x))
    engine.submit(None, list(range(40, 60)), SamplingParams(max_tokens=2), keep_cache=False)
    engine.step()
    rows = padded_rows(20, cpu_shortcuts().pad_rows)  # the step's 20 prompt tokens, as its matmuls run them
    assert calls == [rows] * len(model.layers), "one call per layer over the step's rows"
    engine.close()
