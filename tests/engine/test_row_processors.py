"""Samplers, logits processors and logprobs per row of one batch, each against mlx-lm on a single sequence.

The reference is mlx-lm's own generate_step with mlx-lm's make_sampler / make_logits_processors (after
mx.random.seed(seed) for sampled rows): a row of the batch must give the same tokens and the same log
probabilities whatever its batch mates ask for.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.sample_utils import make_sampler as mlx_make_sampler

from engine.batch.engine import BlockPoolBatchEngine
from engine.core.errors import InvalidRequestError
from engine.core.params import SamplingParams
from engine.core.results import Completion, TokenDelta
from tests.engine.tiny import ByteTokenizer, tiny_model

MAX_TOKENS = 12
PROMPTS = [list(b"hello world"), list(b"the quick brown fox"), list(b"abc"), list(b"zzzz zzzz zzzz")]

#: One case per feature; sampled ones are seeded. Each runs alone and mixed with all the others.
CASES: dict[str, dict[str, Any]] = {
    "greedy": {},
    "top_k": {"temperature": 1.0, "top_k": 5, "seed": 11},
    "min_p": {"temperature": 1.0, "min_p": 0.05, "seed": 12},
    "top_p+top_k+min_p": {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "min_p": 0.01, "seed": 13},
    "repetition": {"repetition_penalty": 1.5, "repetition_context_size": 4},
    "presence": {"presence_penalty": 1.5, "repetition_context_size": 8},
    "frequency": {"frequency_penalty": 1.0, "repetition_context_size": 16},
    "logit_bias": {"logit_bias": ((ord("q"), 5.0), (ord("e"), -100.0))},
    "logprobs": {"logprobs": True, "top_logprobs": 3},
    "sampled+penalties+logprobs": {
        "temperature": 1.0,
        "seed": 14,
        "repetition_penalty": 1.3,
        "frequency_penalty": 0.5,
        "logprobs": True,
        "top_logprobs": 5,
    },
}


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_model("llama")


@pytest.fixture(params=[True, False], ids=["ragged", "mlx-batch"])
def engine(model: Any, request: pytest.FixtureRequest) -> Iterator[BlockPoolBatchEngine]:
    eng = BlockPoolBatchEngine(
        model,
        ByteTokenizer(),
        model_name="tiny-llama",
        pool_blocks=32,
        max_batch=16,
        max_context=4096,
        ragged=request.param,
    )
    yield eng
    eng.close()


def params_of(case: dict[str, Any]) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, **case)


def reference(model: Any, prompt: list[int], case: dict[str, Any]) -> tuple[list[int], list[mx.array]]:
    """mlx-lm on the one sequence: its tokens and each step's logprobs (after the processors)."""
    params = params_of(case)
    mx.random.seed(params.seed or 0)
    sampler = mlx_make_sampler(params.temperature, params.top_p, params.min_p, top_k=params.top_k)
    context = params.repetition_context_size
    processors = make_logits_processors(
        logit_bias=dict(params.logit_bias) or None,
        repetition_penalty=params.repetition_penalty,
        repetition_context_size=context,
        presence_penalty=params.presence_penalty or None,
        presence_context_size=context,
        frequency_penalty=params.frequency_penalty or None,
        frequency_context_size=context,
    )
    tokens, logprobs = [], []
    for token, step_logprobs in generate_step(
        mx.array(prompt), model, max_tokens=MAX_TOKENS, sampler=sampler, logits_processors=processors
    ):
        tokens.append(int(token))
        logprobs.append(step_logprobs)
        if int(token) in ByteTokenizer.eos_token_ids:
            break
    return tokens, logprobs


def run(engine: BlockPoolBatchEngine, rows: list[tuple[list[int], dict[str, Any]]]) -> list[Completion]:
    uids = [engine.submit(None, prompt, params_of(case), keep_cache=False) for prompt, case in rows]
    done: dict[int, Completion] = {}
    while engine.has_work():
        for completion in engine.step().completions:
            done[completion.uid] = completion
    return [done[uid] for uid in uids]


def generated(completion: Completion) -> list[int]:
    """The tokens mlx-lm yields: the generated ones and the EOS that ended them."""
    return completion.token_ids + ([0] if completion.finish_reason == "stop" else [])


def check_against_reference(
    model: Any, prompt: list[int], case: dict[str, Any], completion: Completion
) -> None:
    tokens, logprobs = reference(model, prompt, case)
    assert generated(completion) == tokens
    if not case.get("logprobs"):
        assert completion.logprobs is None
        return
    assert completion.logprobs is not None and len(completion.logprobs) == len(completion.token_ids)
    for token, got, expected in zip(completion.token_ids, completion.logprobs, logprobs, strict=False):
        assert got.logprob == pytest.approx(float(expected[token]), abs=1e-4)
        best = mx.argsort(-expected)[: case["top_logprobs"]].tolist()
        assert [i for i, _ in got.top] == best
        assert [v for _, v in got.top] == pytest.approx([float(expected[i]) for i in best], abs=1e-4)  # type: ignore[union-attr]


@pytest.mark.parametrize("name", list(CASES))
def test_each_feature_alone_equals_mlx_lm(engine: BlockPoolBatchEngine, model: Any, name: str) -> None:
    (completion,) = run(engine, [(PROMPTS[0], CASES[name])])
    check_against_reference(model, PROMPTS[0], CASES[name], completion)


def test_rows_with_different_settings_step_together(engine: BlockPoolBatchEngine, model: Any) -> None:
    rows = [(PROMPTS[i % len(PROMPTS)], case) for i, case in enumerate(CASES.values())]
    completions = run(engine, rows)
    for (prompt, case), completion in zip(rows, completions, strict=True):
        check_against_reference(model, prompt, case, completion)


def test_a_processor_touches_its_own_row_only(engine: BlockPoolBatchEngine) -> None:
    """A row whose processor forbids everything but one token, next to plain greedy rows: they
    decode as they do alone."""
    (alone,) = run(engine, [(PROMPTS[1], {})])

    def only_x(tokens: mx.array, logits: mx.array) -> mx.array:
        assert logits.shape[0] == 1  # one row's logits, never the batch's
        return mx.where(mx.arange(logits.shape[-1]) == ord("x"), logits, -mx.inf)

    forced, plain = run(engine, [(PROMPTS[0], {"logits_processors": (only_x,)}), (PROMPTS[1], {})])
    assert forced.token_ids == [ord("x")] * MAX_TOKENS
    assert plain.token_ids == alone.token_ids


class EndsAfterThree:
    """A processor that ends its row on its third generated token (what a finished grammar does)."""

    def __init__(self) -> None:
        self.seen = 0

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        return logits

    def ends_row(self, token: int) -> bool:
        self.seen += 1
        return self.seen == 3


def test_a_processor_can_end_its_row_only(engine: BlockPoolBatchEngine) -> None:
    (alone,) = run(engine, [(PROMPTS[1], {})])
    ended, plain = run(engine, [(PROMPTS[0], {"logits_processors": (EndsAfterThree(),)}), (PROMPTS[1], {})])
    assert ended.finish_reason == "stop" and len(ended.token_ids) == 3  # the third token is kept
    assert plain.token_ids == alone.token_ids and plain.finish_reason == alone.finish_reason


def test_logprobs_come_with_each_token_delta(engine: BlockPoolBatchEngine) -> None:
    uid = engine.submit(None, PROMPTS[0], params_of({"logprobs": True}), keep_cache=False)
    deltas: list[TokenDelta] = []
    while engine.has_work():
        deltas += [d for d in engine.step().deltas if d.uid == uid]
    assert deltas and all(d.logprobs is not None and d.logprobs.top == () for d in deltas)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"top_k": -1}, "top_k must be a non-negative integer"),
        ({"min_p": 2.0}, r"min_p must be in \[0, 1\]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be positive"),
        ({"repetition_context_size": 0}, "repetition_context_size must be a positive integer"),
        ({"logit_bias": ((256, 1.0),)}, r"logit_bias token id 256 is outside the vocabulary \[0, 256\)"),
        ({"logprobs": True, "top_logprobs": 21}, r"top_logprobs must be in \[0, 20\]"),
        ({"top_logprobs": 2}, "top_logprobs needs logprobs"),
    ],
)
def test_bad_values_are_refused_before_the_batch(
    engine: BlockPoolBatchEngine, fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        engine.submit(None, PROMPTS[0], SamplingParams(max_tokens=4, **fields))
    assert engine.active() == 0 and engine.pool.used_blocks == 0


def test_rows_of_a_state_space_model_mix_too() -> None:
    """The checkpointing backend (SSM state, engine/batch/checkpoints.py) steps mixed rows the same way.

    One prompt for every row: mlx-lm's BatchGenerator left-pads prompts of different lengths, and padding
    run through an SSM's state moves a row's logprobs by up to ~1e-2 (tokens stay equal), whatever the
    processors; here the rows differ in their settings only."""
    model = tiny_model("mamba")
    engine = BlockPoolBatchEngine(
        model, ByteTokenizer(), model_name="tiny-mamba", pool_blocks=32, max_batch=16, ragged=False
    )
    try:
        rows = [(PROMPTS[1], case) for case in CASES.values()]
        for (prompt, case), completion in zip(rows, run(engine, rows), strict=True):
            check_against_reference(model, prompt, case, completion)
    finally:
        engine.close()
