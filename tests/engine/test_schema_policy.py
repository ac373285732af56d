"""Schemas with keywords the grammar cannot hold run instead of being refused; their answers are checked.

A tiny random llama over the builtin SmolLM2 vocabulary (tests/engine/test_grammar.py's fixtures) decodes
under each grammar, then the answer gets the worker's final validation (worker/requests/schema_check.py).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine.batch.engine import BlockPoolBatchEngine
from engine.core.errors import InvalidRequestError
from engine.core.params import OutputGrammar, SamplingParams
from tests.engine.test_grammar import engine, grammar_of, model, prompt, run, tokenizer
from worker.requests.schema_check import schema_check

__all__ = ["engine", "model", "tokenizer"]  # fixtures used here

#: The grammar holds the array to two "a"s; only the unenforced uniqueItems forbids them.
UNIQUE_PAIR = {"type": "array", "items": {"const": "a"}, "minItems": 2, "maxItems": 2, "uniqueItems": True}
#: draft-07 `dependencies`, rewritten into what the grammar enforces: with "a", "b" must come too.
DEPENDENT = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "type": "object",
    "properties": {"a": {"const": 1}, "b": {"const": 2}},
    "required": ["a"],
    "additionalProperties": False,
    "dependencies": {"a": ["b"]},
}


def test_an_answer_breaking_an_unenforced_keyword_is_reported_not_valid(
    engine: BlockPoolBatchEngine, tokenizer: Any
) -> None:
    params = SamplingParams(max_tokens=24, grammar=grammar_of(UNIQUE_PAIR))
    engine.check(params)  # accepted: uniqueItems is left to the final validation
    assert params.grammar is not None
    assert engine.grammars.unenforced(params.grammar) == ('Unimplemented keys: ["uniqueItems"]',)
    (completion,) = run(engine, [(prompt(tokenizer, "Two letters:"), params)])
    assert completion.finish_reason == "stop"  # the grammar ended it: the finish reason stays
    assert json.loads(completion.text) == ["a", "a"]
    check = schema_check(params.grammar, completion.text)
    assert check is not None and not check.valid
    assert check.violation is not None and "uniqueItems" in check.violation


def test_a_rewritten_keyword_is_enforced_and_the_answer_valid(
    engine: BlockPoolBatchEngine, tokenizer: Any
) -> None:
    params = SamplingParams(max_tokens=24, grammar=grammar_of(DEPENDENT))
    assert params.grammar is not None and engine.grammars.unenforced(params.grammar) == ()
    (completion,) = run(engine, [(prompt(tokenizer, "An object:"), params)])
    assert json.loads(completion.text) == {"a": 1, "b": 2}
    check = schema_check(params.grammar, completion.text)
    assert check is not None and check.valid and check.unenforced == []


def test_an_answer_cut_by_max_tokens_is_length_and_not_valid(
    engine: BlockPoolBatchEngine, tokenizer: Any
) -> None:
    params = SamplingParams(max_tokens=2, grammar=grammar_of(DEPENDENT))
    (completion,) = run(engine, [(prompt(tokenizer, "An object:"), params)])
    assert completion.finish_reason == "length"
    check = schema_check(params.grammar, completion.text)
    assert check is not None and not check.valid
    assert check.violation is not None and "not JSON" in check.violation


def test_a_schema_asking_for_strict_compile_is_still_refused(engine: BlockPoolBatchEngine) -> None:
    strict = OutputGrammar("json_schema", json.dumps({**UNIQUE_PAIR, "x-guidance": {"lenient": False}}))
    with pytest.raises(InvalidRequestError, match="cannot be enforced: .*uniqueItems"):
        engine.check(SamplingParams(max_tokens=8, grammar=strict))
