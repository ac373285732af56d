"""Decoding rows' attention and the other rows' softmax in C (engine/cpu/native_attention.py): equal to
MLX's fused call (and numpy's softmax) up to rounding, in order, on any number of threads, and off
(MLX's and numpy's path) where it cannot be built."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine.batch import acceleration
from engine.batch.attention import AttentionCall
from engine.core.params import SamplingParams
from engine.cpu import native_attention
from engine.cpu.shortcuts import cpu_shortcuts, in_ragged_step
from tests.engine.test_ragged import make_engine, prompt, run_all, saved_cache
from tests.engine.tiny import tiny_model

SCALE = 0.125


@pytest.fixture(autouse=True)
def fresh_library() -> Iterator[None]:
    native_attention.library.cache_clear()
    yield
    native_attention.library.cache_clear()


def decoding_row(
    length: int, seed: int, heads: int = 9, kv_heads: int = 3, capacity: int = 0
) -> AttentionCall:
    """One query token over `length` keys, which are the prefix of a `capacity`-line buffer (as
    a row's KVCache hands them over: lines contiguous, heads `capacity` lines apart)."""
    mx.random.seed(seed)
    capacity = max(capacity, length)
    keys = mx.random.normal((1, kv_heads, capacity, 64))
    values = mx.random.normal((1, kv_heads, capacity, 48))  # value dim may differ from the key dim
    return AttentionCall(mx.random.normal((1, heads, 1, 64)), keys[:, :, :length], values[:, :, :length])


def fused(call: AttentionCall) -> mx.array:
    return mx.fast.scaled_dot_product_attention(
        call.queries, call.keys, call.values, scale=SCALE, mask=call.mask
    )


def attend(calls: list[AttentionCall], native: bool = True) -> list[mx.array]:
    if native:
        native_attention.library()  # built before the step, as the engine's start does
    with in_ragged_step(replace(cpu_shortcuts(), native_attention=native)):
        return acceleration.attend(calls, SCALE, None)


def test_the_library_builds_and_fits_decoding_rows_only() -> None:
    assert native_attention.library() is not None, "gcc is on every machine this runs on (.ci/setup)"
    assert native_attention.fits(decoding_row(40, 0))
    suffix = AttentionCall(
        mx.zeros((1, 9, 17, 64)), mx.zeros((1, 3, 40, 64)), mx.zeros((1, 3, 40, 64)), "causal"
    )
    slotted = AttentionCall(mx.zeros((4, 9, 1, 64)), mx.zeros((4, 3, 40, 64)), mx.zeros((4, 3, 40, 64)))
    halves = AttentionCall(
        *(mx.zeros(s, dtype=mx.float16) for s in ((1, 9, 1, 64), (1, 3, 40, 64), (1, 3, 40, 64)))
    )
    odd_dim = AttentionCall(mx.zeros((1, 9, 1, 60)), mx.zeros((1, 3, 40, 60)), mx.zeros((1, 3, 40, 60)))
    assert not any(native_attention.fits(c) for c in (suffix, slotted, halves, odd_dim))
    assert native_attention.fits(replace(slotted, prefix_lengths=(40, 3, 9, 1)))


def slotted_rows(lengths: list[int], width: int, capacity: int) -> AttentionCall:
    """The ShortSlots' call: rows side by side in one (slots * heads, capacity, dim) buffer,
    each keeping a prefix of `width` keys."""
    mx.random.seed(len(lengths) + width)
    slots, heads, kv_heads = len(lengths) + 2, 9, 3
    buffers = [mx.random.normal((slots * kv_heads, capacity, dim)) for dim in (64, 48)]
    k, v = (b.reshape(slots, kv_heads, capacity, -1)[: len(lengths), :, :width] for b in buffers)
    mask = (mx.arange(width)[None, :] < mx.array(lengths)[:, None])[:, None, None, :]
    queries = mx.random.normal((len(lengths), heads, 1, 64))
    return AttentionCall(queries, k, v, mask=mask, prefix_lengths=tuple(lengths))


@pytest.mark.parametrize(
    ("length", "heads", "kv_heads", "capacity"),
    [(1, 9, 3, 0), (7, 9, 3, 256), (700, 9, 3, 768), (3000, 9, 3, 3072), (130, 4, 4, 0), (33, 8, 1, 64)],
)
def test_a_decoding_row_equals_the_fused_call(length: int, heads: int, kv_heads: int, capacity: int) -> None:
    call = decoding_row(length, length, heads, kv_heads, capacity)
    (got,) = attend([call])
    want = fused(call)
    assert got.shape == want.shape
    np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("threads", ["1", "2", "3", "16"])
def test_rows_of_several_lengths_come_back_in_order_on_any_number_of_threads(
    threads: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVRQ_ATTENTION_THREADS", threads)
    calls = [decoding_row(n, seed) for seed, n in enumerate([900, 3, 2600, 1, 64, 1500])]
    suffix = AttentionCall(mx.random.normal((1, 9, 5, 64)), calls[0].keys, calls[0].values, "causal")
    calls.insert(2, suffix)  # goes the split path, between C rows
    calls.insert(4, slotted_rows([300, 2, 511], width=511, capacity=512))  # three C rows in one call
    outputs = attend(calls)
    for call, got in zip(calls, outputs, strict=True):
        np.testing.assert_allclose(np.array(got), np.array(fused(call)), atol=2e-6, rtol=1e-5)


def test_slotted_rows_attend_their_own_prefix_only() -> None:
    call = slotted_rows([40, 1, 7, 39, 20], width=40, capacity=64)
    (got,) = attend([call])
    want = fused(call)
    assert got.shape == want.shape == (5, 9, 1, 48)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-6, rtol=1e-5)


def test_extreme_scores_give_the_softmax_not_nan() -> None:
    call = decoding_row(300, 5)
    call = AttentionCall(call.queries * 400, call.keys, call.values)  # scores spread over thousands
    (got,) = attend([call])
    assert np.isfinite(np.array(got)).all()
    np.testing.assert_allclose(np.array(got), np.array(fused(call)), atol=1e-5, rtol=1e-4)


def test_a_layer_of_decoding_rows_makes_one_c_call(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = native_attention.attend_decode_rows
    monkeypatch.setattr(
        native_attention, "attend_decode_rows", lambda lib, c, s: calls.append(len(c)) or real(lib, c, s)
    )
    attend([decoding_row(n, n) for n in (10, 20, 30)])
    assert calls == [3]
    attend([decoding_row(10, 1)], native=False)
    assert calls == [3], "switched off: MLX's path"


def numpy_softmax(scores: np.ndarray, queries: int) -> tuple[np.ndarray, np.ndarray]:
    """The reference: rows in groups of `queries` causal query tokens, numerators and sums."""
    x = scores.astype(np.float64)
    keys = x.shape[-1]
    if queries > 1:
        row = np.arange(x.shape[-2]) % queries
        x[..., np.arange(keys)[None, :] > keys - queries + row[:, None]] = -np.inf
    x = np.exp(x - x.max(axis=-1, keepdims=True))
    return x, x.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize(
    ("shape", "queries"),
    [((1, 3, 51, 1000), 17), ((1, 3, 51, 3001), 17), ((1, 3, 768, 768), 256), ((2, 3, 12, 40), 4),
     ((1, 3, 6, 333), 1), ((1, 1, 1, 5), 1), ((1, 3, 3, 9), 3)],
)  # fmt: skip
def test_the_c_softmax_equals_numpy_s(shape: tuple[int, ...], queries: int) -> None:
    lib = native_attention.library()
    assert lib is not None
    scores = np.random.default_rng(len(shape) + queries).normal(0, 4, shape).astype(np.float32)
    want, want_totals = numpy_softmax(scores, queries)
    totals = native_attention.softmax_numerators(lib, scores, queries)
    assert totals is not None and totals.shape == (*shape[:-1], 1)
    np.testing.assert_allclose(scores / totals, want / want_totals, atol=1e-7, rtol=2e-6)
    np.testing.assert_allclose(totals, want_totals, rtol=2e-6)
    assert (scores[want == 0] == 0).all(), "keys a causal row does not see weigh exactly 0"


@pytest.mark.parametrize("threads", ["1", "2", "3"])
def test_a_suffix_over_its_history_takes_the_c_softmax_on_any_number_of_threads(
    threads: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVRQ_ATTENTION_THREADS", threads)
    softmaxes: list[int] = []
    real = native_attention.softmax_numerators
    monkeypatch.setattr(
        native_attention, "softmax_numerators", lambda lib, s, q: softmaxes.append(q) or real(lib, s, q)
    )
    history = decoding_row(2500, 3)
    suffix = AttentionCall(mx.random.normal((1, 9, 17, 64)), history.keys, history.values, "causal")
    whole = AttentionCall(suffix.queries, history.keys, history.values)  # every key (no mask)
    masked = slotted_rows([30, 12], width=30, capacity=32)
    masked = AttentionCall(mx.random.normal((2, 9, 2, 64)), masked.keys, masked.values, masked.mask)
    outputs = attend([suffix, whole, masked])
    assert softmaxes == [17, 1], "a boolean mask stays on numpy's path"
    for call, got in zip([suffix, whole, masked], outputs, strict=True):
        np.testing.assert_allclose(np.array(got), np.array(fused(call)), atol=2e-6, rtol=1e-5)


def test_scores_the_c_softmax_cannot_take_go_back_to_numpy() -> None:
    lib = native_attention.library()
    assert lib is not None
    scores = np.ones((1, 3, 8, 20), dtype=np.float32)
    assert native_attention.softmax_numerators(lib, scores[..., ::2], 1) is None, "not in one piece"
    assert native_attention.softmax_numerators(lib, scores.astype(np.float64), 1) is None
    assert native_attention.softmax_numerators(lib, scores, 21) is None, "more queries than keys"


def test_without_a_compiler_attention_stays_on_mlx_s_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("KVRQ_NATIVE_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "/bin/false")  # a compiler that always fails
    assert native_attention.library() is None
    assert "stays on MLX's and numpy's path" in caplog.text
    assert list(tmp_path.iterdir()) == [], "no half-built library left behind"
    call = decoding_row(500, 2)
    (got,) = attend([call])
    np.testing.assert_allclose(np.array(got), np.array(fused(call)), atol=2e-6, rtol=1e-5)


def test_the_library_is_built_once_into_the_cache_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVRQ_NATIVE_CACHE", str(tmp_path))
    assert native_attention.library() is not None
    (built,) = tmp_path.iterdir()
    assert built.name.startswith("attention-") and built.suffix == ".so"
    native_attention.library.cache_clear()

    def refuse(*args: object) -> None:
        raise AssertionError("compiled again")

    monkeypatch.setattr(native_attention, "_compile", refuse)  # a second process loads the built one
    assert native_attention.library() is not None


def load_in_a_new_process(cache: Path) -> bool:
    """Whether a fresh process (dlopen caches what this one loaded, by path) gets the library."""
    code = "from engine.cpu import native_attention; print(native_attention.library() is not None)"
    env = {**os.environ, "KVRQ_NATIVE_CACHE": str(cache)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return done.stdout.strip() == "True"


def test_a_damaged_library_in_the_cache_is_built_again(tmp_path: Path) -> None:
    assert load_in_a_new_process(tmp_path)
    (built,) = tmp_path.iterdir()
    built.write_bytes(b"half a library")
    assert load_in_a_new_process(tmp_path)
    assert built.read_bytes()[:4] == b"\x7fELF", "rebuilt in place"


def test_ragged_steps_with_and_without_c_attention_generate_the_same_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every decoding row here goes to C's attention (two past 512 tokens, one resumed from a
    cache, a short one alone in the ShortSlots) and the tokens equal MLX's path's."""

    def run(native: str) -> list[list[int]]:
        monkeypatch.setenv("KVRQ_NATIVE_ATTENTION", native)
        engine = make_engine(tiny_model("llama"), prefill_tokens_per_step=256)
        cache = saved_cache(engine, 600)
        params = SamplingParams(max_tokens=10, stop_tokens=())
        uids = [engine.submit(None, prompt(n, salt=n), params) for n in (5, 530, 900)]
        uids.append(engine.submit("agent", cache.token_ids + prompt(3, salt=2), params, cache=cache))
        done = run_all(engine)
        engine.close()
        return [done[uid].token_ids for uid in uids]

    c_calls: list[int] = []
    real = native_attention.attend_decode_rows
    monkeypatch.setattr(
        native_attention, "attend_decode_rows", lambda lib, c, s: c_calls.append(len(c)) or real(lib, c, s)
    )
    with_c = run("1")
    assert max(c_calls) == 4, (
        "all four decoding rows in one C call (the short one alone in the ShortSlots: one unmasked row)"
    )
    assert with_c == run("0")
