"""Engine behaviour on a tiny random llama: validation, budgets, cancellation, streaming."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from engine.batch.engine import BlockPoolBatchEngine
from engine.core.errors import (
    CacheMismatchError,
    InvalidRequestError,
    PoolExhaustedError,
    RequestTooLargeError,
)
from engine.core.params import SamplingParams
from engine.core.results import Completion
from tests.engine.tiny import ByteTokenizer, run_all, tiny_model


@pytest.fixture(scope="module")
def model() -> object:
    return tiny_model("llama")


@pytest.fixture
def engine(model: object) -> Iterator[BlockPoolBatchEngine]:
    eng = BlockPoolBatchEngine(
        model, ByteTokenizer(), model_name="tiny-llama", pool_blocks=8, max_batch=4, max_context=4096
    )
    yield eng
    eng.close()


PROMPT = list(b"hello world")


INVALID_REQUESTS: list[tuple[dict[str, object], str]] = [
    ({"prompt_tokens": []}, "prompt is empty"),
    ({"max_tokens": 0}, "max_tokens must be a positive integer"),
    ({"max_tokens": -3}, "max_tokens must be a positive integer"),
    ({"temperature": -0.5}, "temperature must be a number"),
    ({"temperature": float("nan")}, "temperature must be a number"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"seed": -1}, "seed must be a non-negative integer"),
    ({"stop": "END"}, "stop must be a list of non-empty strings"),
    ({"stop": [""]}, "stop must be a list of non-empty strings"),
    ({"stop_tokens": [-1]}, "stop_tokens must be non-negative integers"),
    ({"prompt_tokens": [1, 999_999]}, r"token ids outside the vocabulary \[0, "),
]


@pytest.mark.parametrize(("kwargs", "message"), INVALID_REQUESTS)
def test_invalid_requests_raise_typed_errors_and_change_nothing(
    engine: BlockPoolBatchEngine, kwargs: dict[str, object], message: str
) -> None:
    request: dict[str, Any] = {"prompt_tokens": PROMPT, "max_tokens": 4, **kwargs}
    prompt = request.pop("prompt_tokens")
    with pytest.raises(InvalidRequestError, match=message):
        engine.submit("a", prompt, SamplingParams(**request))
    assert engine.pool.used_blocks == 0 and engine.active() == 0 and not engine.has_work()


def test_prompt_beyond_the_context_is_rejected(engine: BlockPoolBatchEngine) -> None:
    with pytest.raises(
        InvalidRequestError,
        match=r"prompt \(11 tokens\) \+ max_tokens \(4090\) exceeds the model context of 4096",
    ):
        engine.submit("a", PROMPT, SamplingParams(max_tokens=4090))
    assert engine.pool.used_blocks == 0 and engine.active() == 0


def test_cache_from_another_model_is_rejected(engine: BlockPoolBatchEngine) -> None:
    other = BlockPoolBatchEngine(tiny_model("qwen3"), ByteTokenizer(), model_name="tiny-qwen3", pool_blocks=4)
    uid = other.submit("a", PROMPT, SamplingParams(max_tokens=3))
    foreign = run_all(other)[uid].cache
    assert foreign is not None
    with pytest.raises(CacheMismatchError, match="cache was made for tiny-qwen3"):
        engine.submit("a", PROMPT, SamplingParams(max_tokens=3), cache=foreign)
    assert engine.pool.used_blocks == 0 and engine.active() == 0


def test_pool_full_now_is_distinct_from_never_fits(engine: BlockPoolBatchEngine) -> None:
    engine.submit("a", PROMPT, SamplingParams(max_tokens=4 * 256 - len(PROMPT)))  # 4 of 8 blocks
    engine.submit("b", PROMPT, SamplingParams(max_tokens=3 * 256 - len(PROMPT)))  # 3 more
    with pytest.raises(PoolExhaustedError, match="requested 2 blocks, 1 of 8 free"):
        engine.submit("c", PROMPT, SamplingParams(max_tokens=300))
    with pytest.raises(RequestTooLargeError, match="needs 9 blocks but the whole pool holds 8"):
        engine.submit("d", PROMPT, SamplingParams(max_tokens=9 * 256 - len(PROMPT)))
    assert engine.pool.used_blocks == 7 and engine.active() == 2
    assert engine.admission(len(PROMPT), 300).verdict == "later"
    assert engine.admission(len(PROMPT), 10).verdict == "now"
    assert engine.admission(len(PROMPT), 9 * 256 - len(PROMPT)).verdict == "never"


def test_generation_returns_blocks_and_frees_the_pool(engine: BlockPoolBatchEngine) -> None:
    uid = engine.submit("a", PROMPT, SamplingParams(max_tokens=20))
    assert engine.pool.used_blocks == 1
    done = run_all(engine)
    completion = done[uid]
    assert completion.finish_reason in ("length", "stop")
    assert completion.cache is not None
    cache = completion.cache
    assert cache.token_ids[: len(PROMPT)] == PROMPT
    covered = cache.token_ids[len(PROMPT) :]
    assert covered == completion.token_ids[: len(covered)]
    cache.validate(engine.spec)
    assert engine.pool.used_blocks == 0


def test_cache_offset_matches_its_token_list(engine: BlockPoolBatchEngine) -> None:
    """The finished cache covers the prompt and every sampled token but the last (never fed to the
    model): exactly the tokens it lists, so the next turn resumes one token earlier than the text ends."""
    uid = engine.submit("a", PROMPT, SamplingParams(max_tokens=7, stop_tokens=()))
    completion = run_all(engine)[uid]
    assert completion.cache is not None
    n_kv = sum(block.n_tokens for block in completion.cache.blocks)
    sampled = completion.usage.generated_tokens + (1 if completion.finish_reason == "stop" else 0)
    assert n_kv == completion.cache.n_tokens == len(PROMPT) + sampled - 1
    assert completion.cache.token_ids == PROMPT + completion.token_ids[: sampled - 1]


def test_cancel_frees_blocks_and_reports_canceled(engine: BlockPoolBatchEngine) -> None:
    keep = engine.submit("a", PROMPT, SamplingParams(max_tokens=8))
    gone = engine.submit("b", PROMPT, SamplingParams(max_tokens=600))
    engine.step()
    engine.step()
    assert engine.pool.used_blocks == 1 + 3
    cancelled = engine.cancel(gone)
    assert cancelled is not None and cancelled.finish_reason == "canceled" and cancelled.cache is None
    assert engine.pool.used_blocks == 1
    assert engine.cancel(gone) is None
    assert set(run_all(engine)) == {keep}
    assert engine.pool.used_blocks == 0


def test_finish_ends_a_row_as_stopped_with_its_cache(engine: BlockPoolBatchEngine) -> None:
    """What the worker does on a repeated tool call: the row ends now, as if it had stopped by itself."""
    uid = engine.submit("a", PROMPT, SamplingParams(max_tokens=600, stop_tokens=()))
    for _ in range(3):
        engine.step()
    ended = engine.finish(uid)
    done = {uid: ended} if ended is not None else run_all(engine)  # or cut behind, then reported
    completion = done[uid]
    assert completion is not None and completion.finish_reason == "stop"
    assert completion.cache is not None and completion.cache.token_ids[: len(PROMPT)] == PROMPT
    assert completion.usage.generated_tokens == 3
    assert engine.finish(uid) is None and not engine.has_work()
    assert engine.pool.used_blocks == 0


def test_seeded_sampling_does_not_depend_on_batch_mates(engine: BlockPoolBatchEngine) -> None:
    alone = engine.submit("a", PROMPT, SamplingParams(max_tokens=12, temperature=1.0, seed=7, stop_tokens=()))
    first = run_all(engine)[alone].token_ids
    together = engine.submit(
        "a", PROMPT, SamplingParams(max_tokens=12, temperature=1.0, seed=7, stop_tokens=())
    )
    engine.submit("b", list(b"other prompt"), SamplingParams(max_tokens=12, temperature=1.0, seed=8))
    assert run_all(engine)[together].token_ids == first


def test_text_deltas_concatenate_to_the_completion_text(engine: BlockPoolBatchEngine) -> None:
    uids = [
        engine.submit(str(i), PROMPT[: 3 + i], SamplingParams(max_tokens=30, temperature=0.8, seed=i))
        for i in range(3)
    ]
    streamed = dict.fromkeys(uids, "")
    done: dict[int, Completion] = {}
    while engine.has_work():
        out = engine.step()
        for delta in out.deltas:
            streamed[delta.uid] += delta.text
        for completion in out.completions:
            done[completion.uid] = completion
    for uid in uids:
        assert streamed[uid] == done[uid].text


def test_no_blocks_leak_over_many_generations(engine: BlockPoolBatchEngine) -> None:
    start = engine.pool.used_blocks
    for round_ in range(5):
        uids = [engine.submit(f"a{i}", PROMPT, SamplingParams(max_tokens=5 + i)) for i in range(4)]
        engine.step()
        engine.cancel(uids[round_ % 4])
        run_all(engine)
    assert engine.pool.used_blocks == start


def test_keep_cache_false_skips_the_blocks(engine: BlockPoolBatchEngine) -> None:
    uid = engine.submit(None, PROMPT, SamplingParams(max_tokens=5), keep_cache=False)
    completion = run_all(engine)[uid]
    assert completion.cache is None and completion.usage.generated_tokens > 0
    assert engine.pool.used_blocks == 0


def test_memory_shows_where_finished_sequences_memory_went(engine: BlockPoolBatchEngine) -> None:
    per_block = engine.spec.bytes_per_block()
    uid = engine.submit("a", PROMPT, SamplingParams(max_tokens=5))
    completion = run_all(engine)[uid]
    assert completion.cache is not None
    held = engine.memory()
    assert held["slab_lent"] == len(completion.cache.blocks) * per_block  # the completion's blocks
    assert held["arena_idle"] > 0  # the sequence's KV buffers, kept for the next one
    assert held["mlx_active"] >= held["arena_idle"]  # the arena's buffers are MLX arrays
    del completion
    released = engine.memory()
    assert released["slab_lent"] == 0
    assert released["slab_idle"] == held["slab_lent"]  # kept for reuse, counted as idle
