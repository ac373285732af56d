"""The engine on the real builtin SmolLM2: parity with mlx-lm, resume, batching, leaks."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from mlx_lm import generate

from engine.batch.engine import BlockPoolBatchEngine
from engine.core.blocks import AgentCache
from engine.core.errors import InvalidRequestError
from engine.core.params import SamplingParams
from engine.core.results import Completion
from tests.engine.test_engine_tiny import INVALID_REQUESTS
from tests.engine.tiny import run_all

pytestmark = [pytest.mark.slow, pytest.mark.mlx_path]

LONG_TEXT = "The quick brown fox jumps over the lazy dog while the cat watches from the fence. " * 18
CHATS = {
    "short": [{"role": "user", "content": "What is the capital of France?"}],
    "medium": [
        {"role": "system", "content": "You are a terse assistant who answers in one sentence."},
        {"role": "user", "content": "Why is the sky blue? Explain it to a ten year old."},
    ],
    "long": [{"role": "user", "content": "Summarise this text in one line: " + LONG_TEXT}],
}


@pytest.fixture(scope="module")
def engine(smollm2: tuple[Any, Any]) -> Iterator[BlockPoolBatchEngine]:
    model, tokenizer = smollm2
    eng = BlockPoolBatchEngine(model, tokenizer, model_name="smollm2-135m", pool_mb=512)
    yield eng
    eng.close()


def prompt_of(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def test_greedy_output_is_byte_identical_to_mlx_lm(
    engine: BlockPoolBatchEngine, smollm2: tuple[Any, Any]
) -> None:
    model, tokenizer = smollm2
    prompts = {name: prompt_of(tokenizer, chat) for name, chat in CHATS.items()}
    assert len(prompts["long"]) > 256, "the long prompt must span more than one block"
    expected = {
        name: generate(model, tokenizer, p, max_tokens=16, verbose=False) for name, p in prompts.items()
    }
    uids = {name: engine.submit(name, p, SamplingParams(max_tokens=16)) for name, p in prompts.items()}
    done = run_all(engine)
    for name, uid in uids.items():
        assert done[uid].text == expected[name], name
    assert "Paris" in done[uids["short"]].text


def test_resume_matches_fresh_run_and_prefills_only_the_suffix(
    engine: BlockPoolBatchEngine, smollm2: tuple[Any, Any]
) -> None:
    _, tokenizer = smollm2
    turn1 = CHATS["long"]
    first = run_all_one(engine, prompt_of(tokenizer, turn1), max_tokens=12)
    assert first.cache is not None and first.cache.n_tokens > 256
    turn2 = [
        *turn1,
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "Shorter, please."},
    ]
    prompt2 = prompt_of(tokenizer, turn2)
    assert prompt2[: first.cache.n_tokens] == first.cache.token_ids, "turn 2 must extend the cached tokens"

    fresh = run_all_one(engine, prompt2, max_tokens=12)
    processed_before = engine.prompt_tokens_processed()
    resumed = run_all_one(engine, prompt2, max_tokens=12, cache=first.cache)
    suffix = len(prompt2) - first.cache.n_tokens

    assert resumed.text == fresh.text and resumed.token_ids == fresh.token_ids
    assert resumed.usage.reused_tokens == first.cache.n_tokens
    assert resumed.usage.prefilled_tokens == suffix
    # The model itself ran only the suffix (its last token goes through the first decode step).
    assert engine.prompt_tokens_processed() - processed_before == suffix - 1


def test_edited_conversation_reuses_only_the_common_prefix(
    engine: BlockPoolBatchEngine, smollm2: tuple[Any, Any]
) -> None:
    _, tokenizer = smollm2
    first = run_all_one(engine, prompt_of(tokenizer, CHATS["medium"]), max_tokens=8)
    assert first.cache is not None
    edited = [CHATS["medium"][0], {"role": "user", "content": "Why is grass green? Explain it simply."}]
    prompt = prompt_of(tokenizer, edited)
    common = next(i for i, (a, b) in enumerate(zip(prompt, first.cache.token_ids, strict=False)) if a != b)
    resumed = run_all_one(engine, prompt, max_tokens=8, cache=first.cache)
    fresh = run_all_one(engine, prompt, max_tokens=8)
    assert resumed.usage.reused_tokens == common
    assert resumed.token_ids == fresh.token_ids


def test_three_agents_in_one_batch_and_a_late_joiner(
    engine: BlockPoolBatchEngine, smollm2: tuple[Any, Any]
) -> None:
    model, tokenizer = smollm2
    specs = [("short", 6), ("medium", 14), ("long", 10)]
    prompts = {name: prompt_of(tokenizer, CHATS[name]) for name, _ in specs}
    expected = {
        name: generate(model, tokenizer, prompts[name], max_tokens=n, verbose=False) for name, n in specs
    }
    late_prompt = prompt_of(tokenizer, [{"role": "user", "content": "Name a colour."}])
    late_expected = generate(model, tokenizer, late_prompt, max_tokens=5, verbose=False)

    uids = {engine.submit(name, prompts[name], SamplingParams(max_tokens=n)): name for name, n in specs}
    done: dict[int, Completion] = {}
    for _ in range(4):  # everyone is decoding now
        for completion in engine.step().completions:
            done[completion.uid] = completion
    assert engine.active() == 3
    late = engine.submit("late", late_prompt, SamplingParams(max_tokens=5))
    done.update(run_all(engine))
    for uid, name in uids.items():
        assert done[uid].text == expected[name], name
    assert done[late].text == late_expected


def test_pool_returns_to_start_after_twenty_generations(
    engine: BlockPoolBatchEngine, smollm2: tuple[Any, Any]
) -> None:
    _, tokenizer = smollm2
    start = engine.pool.used_blocks
    prompt = prompt_of(tokenizer, CHATS["short"])
    uids = [engine.submit(f"agent{i}", prompt, SamplingParams(max_tokens=3 + i % 4)) for i in range(20)]
    engine.step()
    for uid in uids[::5]:
        cancelled = engine.cancel(uid)
        assert cancelled is not None and cancelled.finish_reason == "canceled"
    done = run_all(engine)
    assert len(done) == 16
    assert engine.pool.used_blocks == start


@pytest.mark.parametrize(("kwargs", "message"), INVALID_REQUESTS)
def test_invalid_requests_on_the_builtin_model(
    engine: BlockPoolBatchEngine, kwargs: dict[str, object], message: str
) -> None:
    before = (engine.pool.used_blocks, engine.active())
    request: dict[str, Any] = {"prompt_tokens": [1, 2, 3], "max_tokens": 4, **kwargs}
    prompt = request.pop("prompt_tokens")
    with pytest.raises(InvalidRequestError, match=message):
        engine.submit("a", prompt, SamplingParams(**request))
    assert (engine.pool.used_blocks, engine.active()) == before


def test_context_limit_on_the_builtin_model(engine: BlockPoolBatchEngine) -> None:
    with pytest.raises(InvalidRequestError, match="exceeds the model context of 8192 tokens"):
        engine.submit("a", [1, 2, 3], SamplingParams(max_tokens=8190))


def run_all_one(
    engine: BlockPoolBatchEngine, prompt: list[int], cache: AgentCache | None = None, **kwargs: Any
) -> Completion:
    uid = engine.submit("agent", prompt, SamplingParams(**kwargs), cache=cache)
    return run_all(engine)[uid]
