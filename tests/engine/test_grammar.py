"""Structured output per row: a grammar row against mlx-lm on a single sequence with the same processor,
grammar rows beside plain and sampled rows, a grammar's end ending only its row, refusals before the batch.

The model is a tiny random llama over the builtin SmolLM2 vocabulary, so llguidance works with a real
byte-level BPE tokenizer (49,152 tokens) while a step costs milliseconds.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import jsonschema
import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler as mlx_make_sampler

from engine.batch.drafters import NgramIndex
from engine.batch.engine import BlockPoolBatchEngine
from engine.core.errors import InvalidRequestError
from engine.core.params import OutputGrammar, SamplingParams
from engine.core.results import Completion
from engine.models.gguf_smollm2 import gguf_path
from engine.models.gguf_tokenizer import tokenizer_from_gguf_metadata
from tests.engine.tiny import tiny_model

VOCAB = 49152
#: Small closed schemas: a random model completes them within a few dozen tokens.
FLAGS = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "color"],
    "additionalProperties": False,
}
LEVEL = {
    "type": "object",
    "properties": {"level": {"type": "integer", "minimum": 0, "maximum": 9}, "done": {"type": "null"}},
    "required": ["level", "done"],
    "additionalProperties": False,
}
CHOICE = {"enum": ["yes", "no", 1, True]}
COMPACT = {"x-guidance": {"whitespace_flexible": False}}  # no free whitespace: a random model ends soon


def grammar_of(schema: dict[str, Any]) -> OutputGrammar:
    return OutputGrammar("json_schema", json.dumps({**schema, **COMPACT}), "test schema")


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    loaded: Any = mx.load(str(gguf_path()), return_metadata=True)
    return tokenizer_from_gguf_metadata(loaded[1])


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_model("llama", vocab_size=VOCAB)


@pytest.fixture(params=[True, False], ids=["ragged", "mlx-batch"])
def engine(model: Any, tokenizer: Any, request: pytest.FixtureRequest) -> Iterator[BlockPoolBatchEngine]:
    eng = BlockPoolBatchEngine(
        model,
        tokenizer,
        model_name="tiny-llama-smol-vocab",
        pool_blocks=64,
        max_batch=16,
        max_context=1024,
        ragged=request.param,
    )
    yield eng
    eng.close()


def prompt(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text))


def run(engine: BlockPoolBatchEngine, rows: list[tuple[list[int], SamplingParams]]) -> list[Completion]:
    uids = [engine.submit(None, tokens, params, keep_cache=False) for tokens, params in rows]
    done: dict[int, Completion] = {}
    while engine.has_work():
        for completion in engine.step().completions:
            done[completion.uid] = completion
    return [done[uid] for uid in uids]


def reference(
    engine: BlockPoolBatchEngine, model: Any, tokens: list[int], params: SamplingParams
) -> list[int]:
    """mlx-lm's generate_step on the one sequence, with the engine's own grammar processor."""
    assert params.grammar is not None
    mx.random.seed(params.seed or 0)
    sampler = mlx_make_sampler(params.temperature, params.top_p, params.min_p, top_k=params.top_k)
    processor = engine.grammars.processor(params.grammar)
    out = []
    for token, _ in generate_step(
        mx.array(tokens),
        model,
        max_tokens=params.max_tokens,
        sampler=sampler,
        logits_processors=[processor],
    ):
        out.append(int(token))
        if processor.matcher.is_stopped():
            break  # the engine ends the row here (ends_row); mlx-lm would go on to an end token
    return out


def valid(completion: Completion, schema: dict[str, Any]) -> Any:
    assert completion.finish_reason == "stop", completion
    document = json.loads(completion.text)
    jsonschema.validate(document, schema)
    return document


CASES = {
    "greedy": SamplingParams(max_tokens=48, grammar=grammar_of(FLAGS)),
    "sampled": SamplingParams(max_tokens=48, temperature=1.0, seed=7, grammar=grammar_of(LEVEL)),
    "sampled+top_k+penalty": SamplingParams(
        max_tokens=48, temperature=0.9, top_k=50, seed=3, repetition_penalty=1.3, grammar=grammar_of(CHOICE)
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_grammar_row_equals_mlx_lm_with_the_same_processor(
    engine: BlockPoolBatchEngine, model: Any, tokenizer: Any, name: str
) -> None:
    tokens = prompt(tokenizer, "Answer in JSON:")
    params = CASES[name]
    (completion,) = run(engine, [(tokens, params)])
    assert completion.token_ids == reference(engine, model, tokens, params)


def test_grammar_rows_step_beside_plain_and_sampled_rows(
    engine: BlockPoolBatchEngine, model: Any, tokenizer: Any
) -> None:
    """Each row's grammar holds its own output only: plain rows decode as they do alone, each grammar
    row is valid against its own schema and equal to mlx-lm's single sequence, and a grammar's end
    ends its row while the others go on."""
    plain = (prompt(tokenizer, "The weather today"), SamplingParams(max_tokens=24))
    sampled = (prompt(tokenizer, "Once upon a time"), SamplingParams(max_tokens=24, temperature=1.0, seed=5))
    alone = run(engine, [plain, sampled])
    grammar_rows = [(prompt(tokenizer, f"JSON {i}:"), CASES[name]) for i, name in enumerate(CASES)]
    mixed = run(engine, [plain, grammar_rows[0], sampled, grammar_rows[1], grammar_rows[2]])
    assert [c.token_ids for c in (mixed[0], mixed[2])] == [c.token_ids for c in alone]
    for (tokens, params), completion, schema in zip(
        grammar_rows, (mixed[1], mixed[3], mixed[4]), (FLAGS, LEVEL, CHOICE), strict=True
    ):
        valid(completion, schema)
        assert completion.token_ids == reference(engine, model, tokens, params)
        assert len(completion.token_ids) < params.max_tokens  # ended by its grammar, not by length
    assert all(len(c.token_ids) == 24 for c in (mixed[0], mixed[2]))  # the plain rows went on


def test_json_object_accepts_any_object(engine: BlockPoolBatchEngine, tokenizer: Any) -> None:
    """response_format json_object's grammar: some JSON object; a random model's is only a prefix of one
    by max_tokens, so the check is that every prefix the row wrote is an object's start."""
    params = SamplingParams(max_tokens=16, grammar=OutputGrammar("json_schema", '{"type": "object"}'))
    (completion,) = run(engine, [(prompt(tokenizer, "{"), params)])
    assert completion.text.lstrip().startswith("{")
    if completion.finish_reason == "stop":
        assert isinstance(json.loads(completion.text), dict)


@pytest.mark.parametrize(
    ("grammar", "message"),
    [
        (OutputGrammar("json_schema", '{"type": "objectx"}', "response_format schema 'x'"), "objectx"),
        (
            OutputGrammar("json_schema", '{"$ref": "#/definitions/missing"}', "response_format schema 'y'"),
            "missing",
        ),
        (OutputGrammar("json_schema", "{not json"), "not JSON"),
        (OutputGrammar("lark", 'start: "a" | undefined_rule'), "undefined_rule"),
    ],
)
def test_a_grammar_that_cannot_be_enforced_is_refused_and_changes_nothing(
    engine: BlockPoolBatchEngine, tokenizer: Any, grammar: OutputGrammar, message: str
) -> None:
    params = SamplingParams(max_tokens=8, grammar=grammar)
    with pytest.raises(InvalidRequestError, match=message) as raised:
        engine.check(params)
    assert "cannot be enforced" in str(raised.value) or "not JSON" in str(raised.value)
    free = engine.pool.free_blocks
    with pytest.raises(InvalidRequestError, match=message):
        engine.submit(None, prompt(tokenizer, "x"), params)
    assert engine.pool.free_blocks == free and not engine.has_work()


def test_a_grammar_compiles_once_per_distinct_source(engine: BlockPoolBatchEngine) -> None:
    grammar = grammar_of(FLAGS)
    engine.check(grammar_params := SamplingParams(max_tokens=4, grammar=grammar))
    compiled = engine.grammars._compiled[grammar]
    engine.check(SamplingParams(max_tokens=9, grammar=OutputGrammar(grammar.kind, grammar.source)))
    assert engine.grammars._compiled[grammar] is compiled and len(engine.grammars._compiled) == 1
    assert grammar_params.processes_logits


#: A document long enough to draft inside: a random model writes its strings token by token.
NOTE = {
    "type": "object",
    "properties": {"title": {"type": "string", "maxLength": 60}, "ok": {"type": "boolean"}},
    "required": ["title", "ok"],
    "additionalProperties": False,
}


def ragged_engine(model: Any, tokenizer: Any, speculation: bool) -> BlockPoolBatchEngine:
    eng = BlockPoolBatchEngine(
        model, tokenizer, model_name="tiny-llama-smol-vocab", pool_blocks=64, speculation=speculation
    )
    if eng.speculation is not None:
        eng.speculation.always = True  # draft wherever a draft exists: the path under test
    return eng


def without_drafts(model: Any, tokenizer: Any, tokens: list[int], params: SamplingParams) -> Completion:
    eng = ragged_engine(model, tokenizer, speculation=False)
    try:
        (completion,) = run(eng, [(tokens, params)])
    finally:
        eng.close()
    return completion


def oracle_drafts(
    monkeypatch: pytest.MonkeyPatch, tokens: list[int], output: list[int], corrupt: float
) -> None:
    """Drafts are the row's true continuation, each token replaced with probability `corrupt` by one
    the grammar mostly does not admit there: drafts kept whole, cut by the grammar, and rejected."""
    rng = random.Random(11)

    def propose(self: NgramIndex, k: int) -> list[int]:
        assert self.tokens[: len(tokens)] == tokens
        done = len(self.tokens) - len(tokens)
        return [t if rng.random() >= corrupt else rng.randrange(VOCAB) for t in output[done : done + k]]

    monkeypatch.setattr(NgramIndex, "propose", propose)


@pytest.mark.parametrize("corrupt", [0.0, 0.3])
def test_a_grammar_row_gives_the_same_tokens_with_drafts_whatever_part_of_them_is_wrong(
    model: Any, tokenizer: Any, monkeypatch: pytest.MonkeyPatch, corrupt: float
) -> None:
    tokens = prompt(tokenizer, "A note as JSON:")
    params = SamplingParams(max_tokens=64, grammar=grammar_of(NOTE))
    expected = without_drafts(model, tokenizer, tokens, params)
    oracle_drafts(monkeypatch, tokens, expected.token_ids, corrupt)
    eng = ragged_engine(model, tokenizer, speculation=True)
    try:
        (drafted,) = run(eng, [(tokens, params)])
        stats = eng.speculation.stats  # type: ignore[union-attr]
    finally:
        eng.close()
    assert drafted.token_ids == expected.token_ids
    assert drafted.text == expected.text and drafted.finish_reason == expected.finish_reason
    assert stats.accepted > 0, "drafts were verified under the grammar's masks"
    if corrupt:
        assert stats.accepted < stats.proposed, "some drafts were cut or rejected"


def test_draft_masks_keep_what_the_grammar_admits_and_leave_the_matcher_where_it_was(
    model: Any, tokenizer: Any
) -> None:
    eng = ragged_engine(model, tokenizer, speculation=True)
    try:
        processor = eng.grammars.processor(grammar_of(NOTE))
    finally:
        eng.close()
    written = prompt(tokenizer, '{"title":"')
    for token in written:
        assert not processor.ends_row(token)
    before = processor._allowed().copy()
    good = prompt(tokenizer, 'two words","ok":true}')
    kept, masks = processor.draft_masks(good + prompt(tokenizer, "}}"))
    assert kept == good, "a draft stops where the grammar stops admitting it (here: after the document)"
    assert masks.shape == (len(good) + 1, VOCAB)
    assert (processor._allowed() == before).all(), "the matcher is where it was"
    for i, token in enumerate(good):  # each position's mask is the grammar's after the drafts before it
        assert (masks[i] == processor._allowed()[0]).all() and masks[i, token]
        processor.ends_row(token)
    assert (masks[len(good)] == processor._allowed()[0]).all()
    assert processor.draft_masks([good[0]])[0] == [], "nothing may follow the complete document"


def test_a_sampled_grammar_row_with_drafts_writes_only_what_its_grammar_admits(
    model: Any, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = prompt(tokenizer, "A note as JSON:")
    expected = without_drafts(
        model, tokenizer, tokens, SamplingParams(max_tokens=64, grammar=grammar_of(NOTE))
    )
    oracle_drafts(monkeypatch, tokens, expected.token_ids, 0.3)  # the greedy text: a sampled row's
    eng = ragged_engine(model, tokenizer, speculation=True)  # drafts pass with the probability it gives them
    sampled = SamplingParams(max_tokens=64, temperature=0.7, grammar=grammar_of(NOTE))  # unseeded: drafts
    try:
        completions = run(eng, [(tokens, sampled)] * 6)
        stats = eng.speculation.stats  # type: ignore[union-attr]
        checker = [eng.grammars.processor(grammar_of(NOTE)) for _ in completions]
    finally:
        eng.close()
    assert stats.proposed > 0
    for completion, processor in zip(completions, checker, strict=True):
        for token in completion.token_ids:  # a token the grammar does not admit raises here
            processor.ends_row(token)
        if completion.finish_reason == "stop":
            valid(completion, NOTE)
