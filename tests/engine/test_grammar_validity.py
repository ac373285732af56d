"""100 sampled generations of the real builtin model over varied JSON schemas: every one ends by its grammar
and is valid against its schema (0 invalid). Rows with different schemas and seeds share each batch.

Strings and arrays carry bounds (maxLength, maxItems) as an agent's schemas do: a 135M model left free
in an unbounded string can fill any max_tokens, and a cut document is invalid whatever the grammar.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from engine.batch.engine import BlockPoolBatchEngine
from engine.core.params import OutputGrammar, SamplingParams

pytestmark = pytest.mark.slow

NAME = {"type": "string", "minLength": 1, "maxLength": 16}
SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "weather call": {
        "type": "object",
        "properties": {
            "city": NAME,
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "tags": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer"}, "admin": {"type": "boolean"}},
                "required": ["id", "admin"],
                "additionalProperties": False,
            },
            "note": {"type": ["string", "null"], "maxLength": 20},
        },
        "required": ["user", "note"],
        "additionalProperties": False,
    },
    "refs": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"from": {"$ref": "#/$defs/point"}, "to": {"$ref": "#/$defs/point"}},
        "required": ["from", "to"],
        "additionalProperties": False,
    },
    "any of": {
        "anyOf": [
            {
                "type": "object",
                "properties": {"ok": {"const": True}},
                "required": ["ok"],
                "additionalProperties": False,
            },
            {
                "type": "object",
                "properties": {"error": NAME},
                "required": ["error"],
                "additionalProperties": False,
            },
        ]
    },
    "pattern": {
        "type": "object",
        "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
        "required": ["date"],
        "additionalProperties": False,
    },
    "list of objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"item": NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
            "required": ["item", "qty"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 3,
    },
    "scores": {
        "type": "object",
        "properties": {
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "label": {"enum": ["positive", "negative", "neutral"]},
            "confident": {"type": "boolean"},
        },
        "required": ["score", "label", "confident"],
        "additionalProperties": False,
    },
    "json object": {
        "type": "object",
        "maxProperties": 3,
        "additionalProperties": {"type": ["integer", "boolean", "null"]},
    },
}
SEEDS = range(10)
MAX_TOKENS = 160


def test_every_sampled_generation_is_valid_against_its_schema(smollm2: tuple[Any, Any]) -> None:
    model, tokenizer = smollm2
    engine = BlockPoolBatchEngine(model, tokenizer, model_name="smollm2", pool_mb=1536, max_batch=50)
    try:
        waiting: list[tuple[list[int], SamplingParams, str, int]] = []
        for name, schema in SCHEMAS.items():
            messages = [
                {
                    "role": "system",
                    "content": "Answer with JSON only, matching this schema: " + json.dumps(schema),
                },
                {"role": "user", "content": f"Give an example {name}."},
            ]
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            grammar = OutputGrammar("json_schema", json.dumps(schema), name)
            for seed in SEEDS:
                params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=seed, grammar=grammar)
                waiting.append((prompt, params, name, seed))
        rows: dict[int, tuple[str, int]] = {}
        invalid = []
        done = 0
        while waiting or engine.has_work():
            while waiting and engine.admission(len(waiting[0][0]), MAX_TOKENS).verdict == "now":
                prompt, params, name, seed = waiting.pop(0)
                rows[engine.submit(None, prompt, params, keep_cache=False)] = (name, seed)
            for completion in engine.step().completions:
                done += 1
                name, seed = rows[completion.uid]
                try:
                    assert completion.finish_reason == "stop", f"ended by {completion.finish_reason}"
                    jsonschema.validate(json.loads(completion.text), SCHEMAS[name])
                except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
                    invalid.append(f"{name} seed {seed}: {str(exc)[:120]}: {completion.text[:200]!r}")
        assert done == len(SCHEMAS) * len(SEEDS) == 100
        assert invalid == []
    finally:
        engine.close()
