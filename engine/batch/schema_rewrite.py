"""Rewrite JSON-schema keywords llguidance does not implement into equivalents it does enforce.

Each rewrite is exact (the rewritten schema accepts the same documents), so the grammar enforces the
keyword instead of ignoring it:

- `dependencies` (drafts 4-7), `dependentRequired` and `dependentSchemas` (2019-09+): "if `a` is present,
  so are `b`, `c`" / "so the object matches S" becomes `anyOf: [{a absent}, {required: [a, b, c]}]` /
  `anyOf: [{a absent}, {allOf: [{required: [a]}, S]}]`, `a absent` written as `properties: {a: false}`;
- `not: {}` / `not: true` (nothing is valid, as in `additionalProperties: {not: {}}`) becomes `false`;
- `not: {required: [a, b]}` becomes `anyOf: [{a absent}, {b absent}]`;
- `not: {type: [...]}` becomes the other JSON types (not where `integer` is excluded but `number` is not:
  no type says "a number that is not an integer").

Anything else is left as sent: llguidance ignores it (lenient) and the answer is validated at the end.
Pure Python on plain JSON values; the input is never modified.
"""

from __future__ import annotations

from collections.abc import Callable, Container
from typing import Any

from jsonschema import validators

#: Keywords whose value is one subschema.
_ONE = (
    "items",
    "additionalItems",
    "additionalProperties",
    "unevaluatedItems",
    "unevaluatedProperties",
    "propertyNames",
    "contains",
    "not",
    "if",
    "then",
    "else",
)
#: Keywords whose value is a list of subschemas.
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
#: Keywords whose value maps names to subschemas.
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
_TYPES = ("string", "number", "integer", "object", "array", "boolean", "null")

Schema = Any  # a dict, or a boolean schema


def rewritten(schema: Schema) -> Schema:
    """`schema` with every rewritable keyword, at any depth, replaced by its enforced equivalent.

    Only keywords of the schema's own draft (its `$schema`, else 2020-12, as the final validation reads
    it) are rewritten: `dependencies` means nothing to 2020-12, so enforcing it there would refuse
    answers the validator accepts.
    """
    if not isinstance(schema, dict):
        return schema
    known = validators.validator_for(schema, default=validators.Draft202012Validator).VALIDATORS
    return _walk(schema, lambda node: _rewrite_one(node, known))


def _walk(schema: Schema, change: Callable[[dict[str, Any]], Schema]) -> Schema:
    """`change` applied to every subschema, innermost first."""
    if not isinstance(schema, dict):
        return schema
    node = dict(schema)
    for key in _ONE:
        if isinstance(node.get(key), dict | bool):
            node[key] = _walk(node[key], change)
    for key in _LIST:
        if isinstance(node.get(key), list):
            node[key] = [_walk(item, change) for item in node[key]]
    for key in _MAP:
        if isinstance(node.get(key), dict):
            node[key] = {name: _walk(item, change) for name, item in node[key].items()}
    return change(node)


def _rewrite_one(node: dict[str, Any], known: Container[str]) -> Schema:
    added: list[Schema] = []
    dependencies = node.get("dependencies")
    if "dependencies" in known and isinstance(dependencies, dict) and _all_dependencies(dependencies):
        added += [_dependency(name, then) for name, then in node.pop("dependencies").items()]
    for key in ("dependentRequired", "dependentSchemas"):
        if key in known and isinstance(node.get(key), dict):
            added += [_dependency(name, then) for name, then in node.pop(key).items()]
    if "not" in node:
        negated = _negation(node["not"])
        if negated is False:
            return False
        if negated is True:  # `not: false`: no constraint
            del node["not"]
        elif negated is not None:
            del node["not"]
            added.append(negated)
    if added:
        node["allOf"] = [*node.get("allOf", []), *added]
    return node


def _dependency(name: str, then: Any) -> Schema:
    """`name` absent, or present with what depends on it."""
    if isinstance(then, list):
        present: Schema = {"required": [name, *then]}
    else:
        present = {"allOf": [{"required": [name]}, then]}
    return {"anyOf": [_absent(name), present]}


def _negation(negated: Any) -> Schema | None:
    """An enforced schema equal to `not: negated`; False when nothing is valid; None when there is none."""
    if negated is True or negated == {}:
        return False
    if negated is False:
        return True
    if not isinstance(negated, dict) or len(negated) != 1:
        return None
    ((key, value),) = negated.items()
    if key == "required" and isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        branches = [_absent(name) for name in value]
        return branches[0] if len(branches) == 1 else {"anyOf": branches}
    if key == "type":
        excluded = {value} if isinstance(value, str) else set(value) if isinstance(value, list) else None
        if (
            excluded is None
            or not excluded <= set(_TYPES)
            or ("integer" in excluded and "number" not in excluded)
        ):
            return None
        if "number" in excluded:
            excluded.add("integer")
        rest = [kind for kind in _TYPES if kind not in excluded]
        return {"type": rest} if rest else False
    return None


def _all_dependencies(dependencies: dict[str, Any]) -> bool:
    return all(isinstance(then, list | dict | bool) for then in dependencies.values())


def _absent(name: str) -> dict[str, Any]:
    return {"properties": {name: False}}
