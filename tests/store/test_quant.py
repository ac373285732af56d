"""KV quantization at rest: sizes, error bounds, dtypes, and checks on the group size."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from engine.kv.quantized import dequantize_cache
from store.disk import DiskStore
from store.quant import QUANT_BITS
from store.redis_store import RedisStore
from tests.store.conftest import make_cache, tiny_spec, tokens

Factory = Callable[..., DiskStore | RedisStore]


def _as_float(array: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array.astype(np.float32)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize(
    ("mode", "group_size", "tolerance"), [("q8", 64, 0.01), ("q4", 32, 0.1), ("q4", 64, 0.15)]
)
def test_quantized_round_trip_is_close_and_keeps_the_dtype(
    backend_factory: Factory, dtype: str, mode: str, group_size: int, tolerance: float
) -> None:
    spec = tiny_spec(dtype)
    store = backend_factory(spec, quantization=mode, group_size=group_size)
    cache = make_cache(spec, tokens(40))
    store.put("a", cache)
    got = store.get("a")
    assert got is not None and got.token_ids == cache.token_ids
    got.validate(spec)  # shapes and storage dtype as the engine expects
    assert got.quantization == (QUANT_BITS[mode], group_size)  # as stored: a pool quantized alike takes it so
    got = dequantize_cache(got)
    worst = 0.0
    for a, b in zip(got.blocks, cache.blocks, strict=True):
        for x, y in zip(a.keys + a.values, b.keys + b.values, strict=True):
            worst = max(worst, float(np.abs(_as_float(x, dtype) - _as_float(y, dtype)).max()))
    assert 0 < worst < tolerance  # values span [-1, 1]: error is a step of the grid, not zero


@pytest.mark.parametrize(("mode", "bits"), [("q8", 8), ("q4", 4)])
def test_quantized_size_matches_the_layout(backend_factory: Factory, mode: str, bits: int) -> None:
    spec = tiny_spec()
    cache = make_cache(spec, tokens(64))
    plain = backend_factory(spec)
    plain.put("a", cache)
    quantized = backend_factory(spec, quantization=mode, group_size=64)
    quantized.put("b", cache)
    plain_info, q_info = plain.info("a"), quantized.info("b")
    assert plain_info is not None and q_info is not None
    # Per 64 values: 64*bits/8 bytes of codes + a float32 scale and bias, vs 256 bytes.
    expected = (64 * bits / 8 + 8) / 256
    ratio = q_info.nbytes / plain_info.nbytes
    assert expected < ratio < expected + 0.05, ratio
    assert q_info.quantization == mode


def test_quantized_blocks_are_reused_across_turns(backend_factory: Factory) -> None:
    spec = tiny_spec()
    store = backend_factory(spec, quantization="q4", group_size=32)
    turn1 = tokens(40)
    store.put("a", make_cache(spec, turn1))
    store.put("a", make_cache(spec, turn1 + tokens(20, seed=1)))
    assert store.stats()["blocks_reused"] == 2


@pytest.mark.parametrize("group_size", [48, 16, 256])
def test_bad_group_sizes_are_refused(backend_factory: Factory, group_size: int) -> None:
    with pytest.raises(ValueError):
        backend_factory(tiny_spec(), quantization="q8", group_size=group_size)


def test_group_size_must_divide_the_head_dim(backend_factory: Factory) -> None:
    from engine.core.spec import LayerSpec, ModelCacheSpec

    spec = ModelCacheSpec("odd", 1, (LayerSpec("full"),), 1, 96, 96, "float32")
    with pytest.raises(ValueError, match="multiple"):
        backend_factory(spec, quantization="q4", group_size=64)
    backend_factory(spec, quantization="q4", group_size=32)  # 96 = 3 x 32
