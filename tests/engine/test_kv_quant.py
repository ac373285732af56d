"""Quantized KV in the pool (kv_bits): budgets, conversions, the store round trip, bad settings.

Tiny random models of the ragged families with head dims that 32-value groups divide
(tests/engine/tiny.py QUANTIZABLE); greedy throughout, so outputs compare exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from engine.batch.engine import BlockPoolBatchEngine
from engine.core.blocks import AgentCache, common_prefix_length
from engine.core.params import SamplingParams
from engine.kv import quantized
from engine.kv.quant import KVQuant
from engine.kv.quantized import quantize_cache, quantized_bytes_per_block
from tests.engine.test_engine_tiny import run_all
from tests.engine.tiny import QUANTIZABLE, ByteTokenizer, tiny_model

FIRST = list(b"The quick brown fox jumps over the lazy dog. " * 6)  # 270 tokens: more than a block
MORE = list(b" And then?")


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request: pytest.FixtureRequest) -> Any:
    return tiny_model(request.param, **QUANTIZABLE[request.param])


def make_engine(
    model: Any, bits: int | None, group_size: int | None = 32, **options: Any
) -> BlockPoolBatchEngine:
    return BlockPoolBatchEngine(
        model,
        ByteTokenizer(),
        model_name="tiny",
        pool_mb=options.pop("pool_mb", 8),
        max_batch=4,
        kv_bits=bits,
        kv_group_size=group_size if bits else None,
        **options,
    )


def generate(
    engine: BlockPoolBatchEngine, prompt: list[int], cache: AgentCache | None = None, n: int = 12
) -> Any:
    uid = engine.submit("a", prompt, SamplingParams(max_tokens=n), cache=cache)
    return run_all(engine)[uid]


def bits_of(engine: BlockPoolBatchEngine) -> int:
    assert engine.kv_quant is not None
    return engine.kv_quant.bits


@pytest.fixture(params=[8, 4])
def quantized_engine(request: pytest.FixtureRequest, model: Any) -> Iterator[BlockPoolBatchEngine]:
    engine = make_engine(model, request.param)
    yield engine
    engine.close()


@pytest.mark.mlx_path
def test_resume_of_a_quantized_cache_equals_a_fresh_prefill(quantized_engine: BlockPoolBatchEngine) -> None:
    first = generate(quantized_engine, FIRST)
    assert first.cache is not None and first.cache.quantization == (bits_of(quantized_engine), 32)
    second_prompt = FIRST + first.token_ids + MORE
    resumed = generate(quantized_engine, second_prompt, first.cache)
    assert resumed.usage.reused_tokens == len(FIRST) + len(first.token_ids) - 1
    fresh = generate(quantized_engine, second_prompt)
    assert fresh.usage.reused_tokens == 0
    assert resumed.token_ids == fresh.token_ids


@pytest.mark.mlx_path
def test_quantized_blocks_go_through_the_store_as_they_are(
    quantized_engine: BlockPoolBatchEngine,
) -> None:
    fakeredis = pytest.importorskip("fakeredis")
    from store.redis_store import RedisStore

    bits = bits_of(quantized_engine)
    store = RedisStore(fakeredis.FakeRedis(), quantized_engine.spec, quantization=f"q{bits}", group_size=32)
    first = generate(quantized_engine, FIRST)
    store.put("a", first.cache)
    got = store.get("a")
    assert got is not None and got.quantization == first.cache.quantization
    assert quantized_engine.pool_precision(got) is got  # no conversion on the way in
    for saved, loaded in zip(first.cache.blocks, got.blocks, strict=True):
        for a, b in zip(saved.keys + saved.values, loaded.keys + loaded.values, strict=True):
            assert np.array_equal(a, b)  # the packed values themselves, not a requantized copy
    second_prompt = FIRST + first.token_ids + MORE
    resumed = generate(quantized_engine, second_prompt, got)
    fresh = generate(quantized_engine, second_prompt)
    assert resumed.usage.reused_tokens > 256 and resumed.token_ids == fresh.token_ids
    store.close()


def test_the_pool_budget_counts_quantized_bytes(model: Any) -> None:
    plain = make_engine(model, None, pool_mb=4)
    spec = plain.spec
    for bits in (8, 4):
        engine = make_engine(model, bits, pool_mb=4)
        per_block = quantized_bytes_per_block(spec, KVQuant(bits, 32))
        assert engine.pool.total_blocks == 4 * 1024 * 1024 // per_block
        # float32 tiny models, head dim 32, groups of 32: dim*bits/8 bytes + a float32 scale and bias
        vector = 32 * bits // 8 + 2 * 4
        assert per_block == spec.n_layers * spec.n_kv_heads * 2 * vector * spec.block_tokens
        assert engine.pool.total_blocks >= plain.pool.total_blocks * (32 * 4) // vector - 1
        done = generate(engine, FIRST, n=4)
        full = done.cache.blocks[0]
        assert full.n_tokens == spec.block_tokens and full.nbytes == per_block  # what a block really holds
        engine.close()
    plain.close()


def test_a_full_precision_cache_is_converted_once_into_a_quantized_pool(
    model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = make_engine(model, None)
    saved = generate(plain, FIRST).cache
    assert saved is not None and saved.quantization is None
    engine = make_engine(model, 8)
    calls: list[int] = []
    original = quantized.quantize_cache

    def counted(cache: AgentCache, quant: KVQuant) -> AgentCache:
        calls.append(1)
        return original(cache, quant)

    monkeypatch.setattr(quantized, "quantize_cache", counted)
    prompt = FIRST + MORE
    from_fp = generate(engine, prompt, saved)
    assert calls == [1] and from_fp.usage.reused_tokens == common_prefix_length(saved.token_ids, prompt)
    assert from_fp.cache is not None and from_fp.cache.quantization == (8, 32)
    # the same as resuming the cache quantized beforehand: one conversion, the pool's own rule
    from_quantized = generate(engine, prompt, original(saved, KVQuant(8, 32)))
    assert calls == [1] and from_fp.token_ids == from_quantized.token_ids
    engine.close()
    plain.close()


def test_a_quantized_cache_is_converted_once_into_a_full_precision_pool(
    model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(model, 4)
    saved = generate(engine, FIRST).cache
    engine.close()
    plain = make_engine(model, None)
    calls: list[int] = []
    original = quantized.dequantize_cache

    def counted(cache: AgentCache) -> AgentCache:
        calls.append(1)
        return original(cache)

    monkeypatch.setattr(quantized, "dequantize_cache", counted)
    done = generate(plain, FIRST + MORE, saved)
    assert calls == [1] and done.usage.reused_tokens == common_prefix_length(saved.token_ids, FIRST + MORE)
    assert done.cache is not None and done.cache.quantization is None
    assert all(k.dtype == np.float32 for block in done.cache.blocks for k in block.keys)
    plain.close()


def test_a_cache_quantized_otherwise_is_requantized_to_the_pool(model: Any) -> None:
    plain = make_engine(model, None)
    saved = generate(plain, FIRST).cache
    plain.close()
    assert saved is not None
    engine = make_engine(model, 4)
    other = quantize_cache(saved, KVQuant(8, 32))
    converted = engine.pool_precision(other)
    assert converted.quantization == (4, 32)
    converted.validate(engine.spec)
    engine.close()


@pytest.mark.parametrize(
    ("bits", "group_size", "message"),
    [
        (3, None, "kv_bits must be 8 or 4"),
        (16, None, "kv_bits must be 8 or 4"),
        (8, 48, "group_size must be one of"),
        (4, 128, "head dim 32 is not a multiple of group_size 128"),
        (None, 64, "kv_group_size is set but kv_bits is not"),
    ],
)
def test_invalid_bits_or_group_size_is_a_clear_error(
    model: Any, bits: int | None, group_size: int | None, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        BlockPoolBatchEngine(
            model, ByteTokenizer(), model_name="tiny", pool_blocks=4, kv_bits=bits, kv_group_size=group_size
        )


def test_a_model_off_the_ragged_batch_refuses_kv_bits() -> None:
    # Every tested family runs on the ragged batch now (tests/engine/test_families.py); the families
    # there that keep their caches unquantized refuse kv_bits in tests/engine/test_ragged_families.py.
    llama = tiny_model("llama", **QUANTIZABLE["llama"])
    with pytest.raises(ValueError, match="kv_bits needs the ragged batch"):
        BlockPoolBatchEngine(
            llama,
            ByteTokenizer(),
            model_name="tiny",
            pool_blocks=4,
            kv_bits=8,
            kv_group_size=32,
            ragged=False,
        )
