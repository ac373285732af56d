"""What the layered cache keeps: sliding layers only their window, SSM state only its last checkpoints,
and how far back each lets a later prompt resume (engine/kv/layered.py, AgentCache.resume_point)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from engine.batch.engine import BlockPoolBatchEngine
from engine.core.errors import CacheMismatchError
from engine.core.params import SamplingParams
from engine.core.results import Completion
from engine.kv.layered import KEEP_CHECKPOINTS, layered_blocks_to_caches
from tests.engine.test_families import prompt_of, reference, run_all
from tests.engine.tiny import ByteTokenizer, tiny_model


def engine_for(arch: str) -> BlockPoolBatchEngine:
    return BlockPoolBatchEngine(
        tiny_model(arch),
        ByteTokenizer(),
        model_name=f"tiny-{arch}",
        pool_blocks=32,
        max_batch=4,
        max_context=4096,
    )


@pytest.fixture(scope="module")
def mamba() -> Iterator[BlockPoolBatchEngine]:
    engine = engine_for("mamba")
    yield engine
    engine.close()


def run(engine: BlockPoolBatchEngine, prompt: list[int], cache: Any = None) -> Completion:
    uid = engine.submit("agent", prompt, SamplingParams(max_tokens=8, stop_tokens=(0,)), cache=cache)
    return run_all(engine)[uid]


def test_ssm_state_keeps_only_the_last_checkpoints(mamba: BlockPoolBatchEngine) -> None:
    cache = run(mamba, prompt_of(900)).cache  # passes the boundaries 256, 512 and 768
    assert cache is not None
    ends = [(i + 1) * 256 for i, block in enumerate(cache.blocks) if block.states]
    assert ends == [512, 768][-KEEP_CHECKPOINTS:]
    state_bytes = sum(a.nbytes for block in cache.blocks for state in block.states for a in state)
    assert state_bytes == len(ends) * mamba.spec.state_bytes()
    assert [cache.resume_point(n) for n in (900, 767, 600, 511, 300)] == [768, 512, 512, 0, 0]


def test_a_resumed_turn_keeps_the_checkpoints_it_stood_on(mamba: BlockPoolBatchEngine) -> None:
    first = run(mamba, prompt_of(600)).cache
    assert first is not None
    prompt = list(first.token_ids) + prompt_of(60, salt=9)
    second = run(mamba, prompt, cache=first)
    assert second.usage.reused_tokens == 512
    assert second.token_ids == reference(mamba.model, prompt, 8)
    assert second.cache is not None
    assert [(i + 1) * 256 for i, b in enumerate(second.cache.blocks) if b.states] == [256, 512]
    assert second.cache.blocks[0].states is first.blocks[0].states  # carried over, not recomputed


def test_a_checkpoint_is_taken_while_generating(mamba: BlockPoolBatchEngine) -> None:
    """The sequence crosses 256 during generation: the state after the token that completes the block."""
    uid = mamba.submit("agent", prompt_of(250), SamplingParams(max_tokens=20))
    cache = run_all(mamba)[uid].cache
    assert cache is not None and cache.n_tokens >= 256
    assert cache.blocks[0].states
    prompt = list(cache.token_ids[:256]) + prompt_of(30, salt=4)
    resumed = run(mamba, prompt, cache=cache)
    assert resumed.usage.reused_tokens == 256
    assert resumed.token_ids == reference(mamba.model, prompt, 8)


def test_sliding_layers_store_only_their_window() -> None:
    engine = engine_for("gemma3_text")  # window 32, 4 of its 6 layers sliding
    try:
        cache = run(engine, prompt_of(600)).cache
    finally:
        engine.close()
    assert cache is not None
    for layer in engine.spec.kv_layers():
        held = sum(int(block.keys[layer.index].shape[1]) for block in cache.blocks)
        assert held == (32 if layer.kind == "sliding" else cache.n_tokens)
    assert cache.resume_point(cache.n_tokens) == cache.n_tokens
    assert cache.resume_point(cache.n_tokens - 1) == cache.n_tokens - 1  # the window still holds 31 before it
    assert cache.resume_point(cache.n_tokens - 2) == 0
    with pytest.raises(CacheMismatchError, match="cannot resume exactly at token 500"):
        layered_blocks_to_caches(cache, 500)
