"""Every model family mlx-lm can batch, on tiny random models: the engine's greedy tokens equal
`mlx_lm.generate`'s, and a resume from the agent's saved cache equals a fresh prefill."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from engine.batch.engine import BlockPoolBatchEngine
from engine.core.errors import UnsupportedModelError
from engine.core.params import SamplingParams
from engine.core.results import Completion
from store import open_store
from tests.engine.tiny import QUANTIZABLE, ByteTokenizer, run_all, tiny_model

pytestmark = pytest.mark.mlx_path  # run again with KVRQ_CPU_SHORTCUTS=0 by .ci/test

FAMILIES = [
    "llama",
    "mistral",
    "qwen3",
    "qwen3_moe",
    "mixtral",
    "phi3",
    "gemma3_text",
    "ministral3",
    "gpt_oss",
    "deepseek_v2",
    "deepseek_v3",
    "openelm",
    "qwen3_next",
    "qwen3_5",
    "falcon_h1",
    "mamba",
    "mamba2",
]

# The families the ragged batch runs (engine/batch/ragged.py SUPPORTED_MODULES; mistral runs as
# llama); every other one falls back to mlx-lm's BatchGenerator.
RAGGED = {
    "llama",
    "mistral",
    "qwen3",
    "mixtral",
    "qwen3_moe",
    "phi3",
    "gemma3_text",
    "ministral3",
    "gpt_oss",
    "openelm",
    "deepseek_v2",
    "deepseek_v3",
    "qwen3_next",
    "qwen3_5",
    "falcon_h1",
    "mamba",
    "mamba2",
}

EOS = 0
TEXT = (
    "The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. "
    "Sphinx of black quartz, judge my vow. How vexingly quick daft zebras jump! "
)


def prompt_of(n_tokens: int, salt: int = 0) -> list[int]:
    data = (TEXT * (n_tokens // len(TEXT) + 2)).encode()[salt : salt + n_tokens]
    return list(data)


def reference(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    """mlx_lm's own single-sequence greedy decode, cut where the engine stops (EOS, not emitted)."""
    tokens = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens, sampler=greedy):
        if int(token) == EOS:
            break
        tokens.append(int(token))
    return tokens


def greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest) -> tuple[str, Any]:
    return request.param, tiny_model(request.param)


@pytest.fixture
def engine(family: tuple[str, Any]) -> Iterator[BlockPoolBatchEngine]:
    arch, model = family
    eng = BlockPoolBatchEngine(
        model, ByteTokenizer(), model_name=f"tiny-{arch}", pool_blocks=32, max_batch=4, max_context=2048
    )
    yield eng
    eng.close()


def test_the_verified_families_run_on_the_ragged_batch(
    family: tuple[str, Any], engine: BlockPoolBatchEngine
) -> None:
    arch, _model = family
    assert engine.ragged == (arch in RAGGED)


def test_batched_greedy_equals_mlx_lm_generate(family: tuple[str, Any], engine: BlockPoolBatchEngine) -> None:
    _arch, model = family
    prompts = [prompt_of(40), prompt_of(17, salt=5), prompt_of(300, salt=11)]
    uids = [engine.submit(f"a{i}", p, SamplingParams(max_tokens=12)) for i, p in enumerate(prompts)]
    done = run_all(engine)
    for uid, prompt in zip(uids, prompts, strict=True):
        assert done[uid].token_ids == reference(model, prompt, 12)


def test_a_family_mlx_lm_cannot_batch_fails_at_load_naming_the_layer() -> None:
    with pytest.raises(UnsupportedModelError, match=r"^layer 0 uses ChunkedKVCache: mlx-lm cannot batch it"):
        BlockPoolBatchEngine(tiny_model("llama4"), ByteTokenizer(), model_name="tiny-llama4", pool_blocks=4)


def expected_reuse(engine: BlockPoolBatchEngine, cached: int, shared: int) -> int:
    """What a cache of `cached` tokens may give a prompt sharing `shared` of them, by the model's layers."""
    spec = engine.spec
    if spec.has_state_layers:
        return shared // spec.block_tokens * spec.block_tokens  # the last checkpoint inside the prefix
    if spec.has_sliding_layers:
        return shared if shared >= cached - 1 else 0  # only the window of the cache's end is kept
    return shared


def first_turn(engine: BlockPoolBatchEngine) -> Completion:
    uid = engine.submit("agent", prompt_of(300), SamplingParams(max_tokens=12, stop_tokens=(EOS,)))
    completion = run_all(engine)[uid]
    assert completion.cache is not None
    completion.cache.validate(engine.spec)
    return completion


@pytest.mark.parametrize("edit_at", [None, -1, 280, 100])
def test_resume_equals_fresh_prefill(
    family: tuple[str, Any], engine: BlockPoolBatchEngine, edit_at: int | None
) -> None:
    """A next turn (the cache + new tokens), or an edited history, resumes from what it may and
    generates exactly what a fresh prefill of the same prompt generates."""
    _arch, model = family
    cache = first_turn(engine).cache
    assert cache is not None
    prompt = list(cache.token_ids) + prompt_of(40, salt=3)
    if edit_at is not None:
        edit_at %= cache.n_tokens  # -1: the cache's last token differs (the window holds one token less)
        prompt[edit_at] = (prompt[edit_at] + 1) % 256 or 1
    uid = engine.submit("agent", prompt, SamplingParams(max_tokens=12), cache=cache)
    resumed = run_all(engine)[uid]
    shared = min(edit_at if edit_at is not None else cache.n_tokens, len(prompt) - 1)
    assert resumed.usage.reused_tokens == expected_reuse(engine, cache.n_tokens, shared)
    assert resumed.token_ids == reference(model, prompt, 12)


# q8 at rest is lossy: where a random tiny model's top-2 margin were below the error it adds, greedy
# would flip. No family here does on the ragged batch (qwen3_5 did on mlx-lm's BatchGenerator: a top-2
# margin of 0.007 at the 2nd token under q8's ~0.001), so every q8 resume must equal the fresh prefill.


@pytest.fixture(scope="module", params=FAMILIES)
def quantizable(request: pytest.FixtureRequest) -> tuple[str, Any]:
    return request.param, tiny_model(request.param, **QUANTIZABLE[request.param])


@pytest.mark.parametrize("quantization", ["none", "q8"])
@pytest.mark.parametrize("backend", ["disk", pytest.param("redis", marks=pytest.mark.integration)])
def test_resume_through_the_store_equals_fresh_prefill(
    quantizable: tuple[str, Any],
    backend: str,
    quantization: str,
    request: pytest.FixtureRequest,
    tmp_path: Path,
) -> None:
    """Turn 1's cache goes through a real store (a fresh instance reads it: nothing in memory) and
    the next turn, and an edited one, resume from it exactly as a fresh prefill would run."""
    arch, model = quantizable
    uri = f"disk:{tmp_path / 'store'}" if backend == "disk" else request.getfixturevalue("redis_url")
    engine = BlockPoolBatchEngine(
        model, ByteTokenizer(), model_name=f"tiny-{arch}", pool_blocks=32, max_batch=4, max_context=2048
    )
    options: dict[str, Any] = {"quantization": quantization, "group_size": 32, "hot_tier_bytes": 0}
    try:
        cache = first_turn(engine).cache
        assert cache is not None
        writer = open_store(uri, engine.spec, **options)
        assert writer.put("agent", cache).result() is True
        writer.close()
        reader = open_store(uri, engine.spec, **options)
        for edit_at in (None, 280):
            prompt = list(cache.token_ids) + prompt_of(40, salt=7)
            if edit_at is not None:
                prompt[edit_at] = (prompt[edit_at] + 1) % 256 or 1
            stored = reader.get("agent", prompt_tokens=prompt)
            assert stored is not None, reader.stats()
            uid = engine.submit("agent", prompt, SamplingParams(max_tokens=12), cache=stored)
            resumed = run_all(engine)[uid]
            shared = min(edit_at if edit_at is not None else cache.n_tokens, len(prompt) - 1)
            assert resumed.usage.reused_tokens == expected_reuse(engine, cache.n_tokens, shared)
            assert resumed.token_ids == reference(model, prompt, 12)
        reader.close()
    finally:
        engine.close()
