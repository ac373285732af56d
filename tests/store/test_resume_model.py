"""Resume through the store on the real builtin model: what comes back must generate the same text.

Turn 1 runs a long chat (more than one 256-token block) and its cache is stored; turn 2
(the chat + the answer + a new question) is generated once from scratch and once from
the stored cache. With `none` the tokens must be identical; quantized caches are
measured (benchmarks/bench_store.py reports their agreement) and must still resume.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.batch.engine import BlockPoolBatchEngine
from engine.core.blocks import AgentCache
from engine.core.params import SamplingParams
from engine.core.results import Completion
from store.backend import BlockBackend
from store.disk import DiskStore
from store.factory import open_store
from store.quant import Quantization
from store.redis_store import RedisStore

pytestmark = pytest.mark.slow

SYSTEM = "You are a careful assistant. " + "Answer with short, plain sentences and no lists. " * 30
QUESTION = "Why do leaves change colour in autumn?"
FOLLOW_UP = "And why do some trees keep their leaves all winter?"
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def engine(smollm2: tuple[Any, Any]) -> Iterator[BlockPoolBatchEngine]:
    model, tokenizer = smollm2
    eng = BlockPoolBatchEngine(model, tokenizer, model_name="smollm2-135m", pool_mb=512)
    yield eng
    eng.close()


def run(engine: BlockPoolBatchEngine, prompt: list[int], cache: AgentCache | None) -> Completion:
    uid = engine.submit("agent", prompt, SamplingParams(max_tokens=NEW_TOKENS), cache=cache)
    while True:
        for completion in engine.step().completions:
            if completion.uid == uid:
                return completion


def chat(tokenizer: Any, *turns: str) -> list[int]:
    messages = [{"role": "system", "content": SYSTEM}]
    for index, text in enumerate(turns):
        messages.append({"role": "user" if index % 2 == 0 else "assistant", "content": text})
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


@pytest.fixture(scope="module")
def conversation(engine: BlockPoolBatchEngine) -> dict[str, Any]:
    """Turn 1's completion, turn 2's prompt, and turn 2 generated from scratch (the reference)."""
    prompt1 = chat(engine.tokenizer, QUESTION)
    assert len(prompt1) > 256, "turn 1 must fill at least one whole block"
    turn1 = run(engine, prompt1, None)
    assert turn1.cache is not None
    prompt2 = chat(engine.tokenizer, QUESTION, turn1.text, FOLLOW_UP)
    fresh = run(engine, prompt2, None)
    return {"turn1": turn1, "prompt2": prompt2, "fresh": fresh}


def _backend(
    kind: str, tmp_path: Path, engine: BlockPoolBatchEngine, quantization: Quantization, url: str
) -> Any:
    if kind == "disk":
        return DiskStore(tmp_path / "s", engine.spec, quantization=quantization)
    if kind == "redis":
        return RedisStore(url, engine.spec, quantization=quantization)
    return open_store(f"disk:{tmp_path / 'h'}", engine.spec, quantization=quantization, hot_tier_bytes=0)


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["disk", "redis", "hot-tier"])
@pytest.mark.parametrize("quantization", ["none", "q8", "q4"])
def test_resume_from_every_backend(
    engine: BlockPoolBatchEngine,
    conversation: dict[str, Any],
    kind: str,
    quantization: Quantization,
    tmp_path: Path,
    redis_url: str,
) -> None:
    store = _backend(kind, tmp_path, engine, quantization, redis_url)
    turn1: Completion = conversation["turn1"]
    assert turn1.cache is not None
    store.put("agent", turn1.cache)
    if kind == "hot-tier":
        store.flush()  # hot_tier_bytes=0: the get below really reads the disk
    got = store.get("agent")
    assert got is not None and got.token_ids == turn1.cache.token_ids
    resumed = run(engine, conversation["prompt2"], got)
    assert resumed.usage.reused_tokens > 256
    assert resumed.usage.prefilled_tokens < len(conversation["prompt2"]) - 256
    if quantization == "none":
        assert resumed.token_ids == conversation["fresh"].token_ids
        assert resumed.text == conversation["fresh"].text
    else:
        assert len(resumed.token_ids) > 0
    assert resumed.cache is not None
    store.put("agent", resumed.cache)  # turn 2 keeps turn 1's full blocks
    if kind == "hot-tier":
        store.flush()
    stats = store.stats()
    assert stats["blocks_reused"] >= 1
    store.close()


def test_edited_conversation_reuses_only_the_common_prefix(
    engine: BlockPoolBatchEngine, conversation: dict[str, Any], backend_factory: Callable[..., BlockBackend]
) -> None:
    store = backend_factory(engine.spec)
    turn1: Completion = conversation["turn1"]
    assert turn1.cache is not None
    store.put("agent", turn1.cache)
    edited = chat(engine.tokenizer, "Why do leaves turn red in autumn?", turn1.text, FOLLOW_UP)
    got = store.get("agent", prompt_tokens=edited)
    assert got is not None
    assert 256 < got.n_tokens < len(turn1.cache.token_ids)
    assert got.token_ids == edited[: got.n_tokens]
    assert edited[got.n_tokens] != turn1.cache.token_ids[got.n_tokens]  # stops where they differ
    resumed = run(engine, edited, got)
    fresh = run(engine, edited, None)
    assert resumed.usage.reused_tokens == got.n_tokens
    assert resumed.token_ids == fresh.token_ids
