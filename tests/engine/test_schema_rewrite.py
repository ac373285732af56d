"""Schema rewrites are exact (the full validator judges every instance the same before and after) and make
llguidance enforce the keyword; what has no equivalent is left for the final validation. No model."""

from __future__ import annotations

import copy
from typing import Any

import jsonschema
import pytest

from engine.batch.json_schema import compile_json_schema
from engine.batch.schema_rewrite import rewritten

AB = {"a": {"type": "integer"}, "b": {"type": "integer"}, "c": {"type": "integer"}}
DRAFT7 = "http://json-schema.org/draft-07/schema#"
CASES: dict[str, tuple[dict[str, Any], list[Any]]] = {
    "dependencies, a list": (
        {"$schema": DRAFT7, "type": "object", "properties": AB, "dependencies": {"a": ["b", "c"]}},
        [{}, {"a": 1}, {"a": 1, "b": 2}, {"a": 1, "b": 2, "c": 3}, {"b": 2}],
    ),
    "dependencies, a schema": (
        {"$schema": DRAFT7, "type": "object", "properties": AB, "dependencies": {"a": {"required": ["c"]}}},
        [{}, {"a": 1}, {"a": 1, "c": 3}, {"c": 3}],
    ),
    "dependentRequired": (
        {"type": "object", "properties": AB, "dependentRequired": {"b": ["a"]}},
        [{}, {"b": 1}, {"a": 1, "b": 2}, {"a": 1}],
    ),
    "dependentSchemas": (
        {
            "type": "object",
            "properties": AB,
            "dependentSchemas": {"b": {"properties": {"a": {"minimum": 5}}}},
        },
        [{"b": 1}, {"a": 1, "b": 2}, {"a": 6, "b": 2}, {"a": 1}],
    ),
    "not {} as additionalProperties": (
        {"type": "object", "properties": AB, "additionalProperties": {"not": {}}},
        [{"a": 1}, {"a": 1, "z": 2}, {}],
    ),
    "not required": (
        {"type": "object", "properties": AB, "not": {"required": ["a", "b"]}},
        [{}, {"a": 1}, {"b": 1}, {"a": 1, "b": 2}, {"a": 1, "c": 3}],
    ),
    "not type": (
        {"type": ["string", "number", "null"], "not": {"type": "number"}},
        ["x", 1, 1.5, None],
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_rewrite_keeps_every_verdict_and_is_enforced(name: str) -> None:
    schema, instances = CASES[name]
    sent = copy.deepcopy(schema)
    changed = rewritten(schema)
    assert schema == sent  # the request's schema is never modified
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    verdicts = [validator(schema).is_valid(value) for value in instances]
    assert verdicts == [validator(changed).is_valid(value) for value in instances]
    assert True in verdicts and False in verdicts  # the instances tell the keyword's two sides apart
    assert compile_json_schema(schema).unenforced == ()


def test_dependencies_are_left_to_drafts_that_define_them() -> None:
    schema = {"type": "object", "properties": AB, "dependencies": {"a": ["b"]}}  # 2020-12: no such keyword
    assert rewritten(schema) == schema
    assert jsonschema.Draft202012Validator(schema).is_valid({"a": 1})


def test_keywords_as_property_names_and_values_are_left_alone() -> None:
    schema = {
        "type": "object",
        "properties": {"not": {"type": "string"}, "dependencies": {"enum": [{"not": {}}]}},
        "default": {"oneOf": 1},
    }
    assert rewritten(schema) == schema


def test_what_has_no_equivalent_is_left_and_named_unenforced() -> None:
    schema = {
        "type": "object",
        "properties": {"kind": {"enum": ["a", "b"]}, "tags": {"type": "array", "uniqueItems": True}},
        "if": {"properties": {"kind": {"const": "a"}}},
        "then": {"required": ["tags"]},
        "not": {"properties": {"kind": {"const": "b"}}},
    }
    assert rewritten(schema) == schema
    unenforced = " ".join(compile_json_schema(schema).unenforced)
    for keyword in ("if", "then", "not", "uniqueItems"):
        assert f'"{keyword}"' in unenforced


def test_one_of_is_enforced_as_any_of_and_named_where_branches_may_overlap() -> None:
    assert compile_json_schema({"oneOf": [{"type": "integer"}, {"type": "string"}]}).unenforced == ()
    (overlap,) = compile_json_schema({"oneOf": [{"type": "integer"}, {"type": "number"}]}).unenforced
    assert overlap.startswith("oneOf not fully supported, falling back to anyOf")


def test_a_schema_asking_for_strict_compile_is_refused_naming_the_keyword() -> None:
    with pytest.raises(ValueError, match="uniqueItems"):
        compile_json_schema({"type": "array", "uniqueItems": True, "x-guidance": {"lenient": False}})
