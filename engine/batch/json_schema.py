"""A JSON schema as llguidance enforces it: compiled leniently, with what it left unenforced named.

Real-world schemas use keywords llguidance's grammar cannot hold (`not`, `if`/`then`, `uniqueItems`,
`contains`, unknown `format`s, `oneOf`). Refusing them refused about one schema in six of the MaskBench
corpus, so instead: what has an equivalent llguidance enforces is rewritten into it (schema_rewrite.py),
`oneOf` is enforced as `anyOf` (coerce_one_of: exact where llguidance proves the branches disjoint, else it
warns), every other unimplemented keyword is ignored by the grammar (lenient); each warning is kept in
`unenforced`. The finished answer is then validated against the full
schema (worker/schema_check.py), so an answer breaking an unenforced keyword is reported, never passed.

A schema's own "x-guidance" options win over these defaults: `{"lenient": false}` asks for the refusal.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llguidance

from engine.batch.schema_rewrite import rewritten
from engine.core.params import with_json_whitespace

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

#: llguidance's JSON compile options under a schema's own "x-guidance" (which may override them).
COMPILE_DEFAULTS: JsonCompileOptions = {"lenient": True, "coerce_one_of": True}
_KEPT = 64


@dataclass(frozen=True)
class CompiledGrammar:
    """An llguidance grammar and, one line each, what it does not enforce of the schema it came from."""

    grammar: str
    unenforced: tuple[str, ...] = ()


def compile_json_schema(schema: Any, tokenizer: llguidance.LLTokenizer | None = None) -> CompiledGrammar:
    """The grammar of `schema` (rewritten where that enforces more), or ValueError with llguidance's reason.

    A rewrite that llguidance cannot compile (a deep intersection, say) falls back to the schema as sent:
    the rewrite may only add enforcement, never a refusal.
    """
    candidates = [rewritten(schema), schema] if isinstance(schema, dict) else [schema]
    problem = ""
    for candidate in candidates:
        text = grammar_text(candidate)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, tokenizer)
        if not is_error:
            unenforced = [_first_line(message) for message in messages]
            return CompiledGrammar(text, tuple(dict.fromkeys(unenforced)))
        problem = problem or (_first_line(messages[0]) if messages else "unknown error")
    raise ValueError(problem)


def grammar_text(schema: Any) -> str:
    """llguidance's grammar for `schema` as sent (no rewrite, not validated), with kvrq's whitespace rule."""
    return str(
        llguidance.LLMatcher.grammar_from_json_schema(with_json_whitespace(schema), defaults=COMPILE_DEFAULTS)
    )


@functools.lru_cache(maxsize=_KEPT)
def unenforced_keywords(source: str) -> tuple[str, ...]:
    """What the grammar of the schema `source` (JSON text) leaves unenforced; () if it does not compile.

    Compiled without a tokenizer: the JSON compiler's warnings do not depend on it. Cached per schema,
    so an agent sending the same schema every turn compiles it here once.
    """
    try:
        return compile_json_schema(json.loads(source)).unenforced
    except ValueError:
        return ()


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else message
