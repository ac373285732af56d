"""Every finished response_format answer validated against its full schema.

The grammar enforces what llguidance can and ignores the rest (engine/batch/json_schema.py): an answer
may break `not`, `if`/`then`, `uniqueItems`, a `format` llguidance does not know, or a `oneOf` it held
as `anyOf`, and max_tokens may cut it. So the result never says "valid" on the grammar's word: it says
what the validator (jsonschema, the schema's own draft or 2020-12, format checker on, with RFC 3339
`date-time` checked here) found. A `format` neither llguidance nor jsonschema knows is an annotation,
as JSON Schema says: it is named in `unenforced`, not judged.
"""

from __future__ import annotations

import datetime
import functools
import json
import re
from typing import Any

from jsonschema import FormatChecker, exceptions, validators
from jsonschema.protocols import Validator

from engine.batch.json_schema import unenforced_keywords
from engine.core.params import OutputGrammar
from producer.models import SchemaCheck

_VIOLATION_CHARS = 300
_KEPT = 64
_DATE_TIME = re.compile(
    r"(?P<date>\d{4}-\d{2}-\d{2})[Tt](?P<h>\d{2}):(?P<m>\d{2}):(?P<s>\d{2})(\.\d+)?(?P<offset>[Zz]|[+-]\d{2}:\d{2})\Z"
)


def schema_check(grammar: OutputGrammar | None, answer: str) -> SchemaCheck | None:
    """`answer` checked against the JSON schema of `grammar`; None for no grammar or a Lark one."""
    if grammar is None or grammar.kind != "json_schema":
        return None
    return SchemaCheck(
        valid=(violation := answer_violation(grammar.source, answer)) is None,
        violation=violation,
        unenforced=list(unenforced_keywords(grammar.source)),
    )


def answer_violation(source: str, answer: str) -> str | None:
    """Where and how `answer` breaks the schema `source` (JSON text); None when it is valid."""
    try:
        document = json.loads(answer)
    except json.JSONDecodeError as exc:
        return _short(f"the answer is not JSON: {exc}")
    return instance_violation(source, document)


def instance_violation(source: str, document: Any) -> str | None:
    """Where and how the JSON value `document` breaks the schema `source`; None when it is valid.

    A schema the validator cannot apply (a reference it cannot resolve, a pattern Python cannot
    compile) is a violation too: nothing unchecked is called valid.
    """
    try:
        error = exceptions.best_match(_validator(source).iter_errors(document))
    except Exception as exc:  # jsonschema raises many kinds (Unresolvable, re.error, ...): all unchecked
        return _short(f"the answer could not be checked against the schema: {type(exc).__name__}: {exc}")
    if error is None:
        return None
    where = "/".join(str(part) for part in error.absolute_path)
    return _short(f"at /{where}: {error.message} (keyword {error.validator!r})")


@functools.lru_cache(maxsize=_KEPT)
def _validator(source: str) -> Validator:
    schema = json.loads(source)
    cls = validators.validator_for(schema, default=validators.Draft202012Validator)
    checker = FormatChecker(formats=())
    checker.checkers = {**cls.FORMAT_CHECKER.checkers, "date-time": (_is_date_time, ValueError)}
    return cls(schema, format_checker=checker)


def _is_date_time(value: object) -> bool:
    """RFC 3339 date-time, the commonest `format`: jsonschema checks it only with an optional package."""
    if not isinstance(value, str):
        return True
    match = _DATE_TIME.match(value)
    if match is None:
        return False
    datetime.date.fromisoformat(match["date"])  # ValueError: no such day
    hour, minute, second, offset = int(match["h"]), int(match["m"]), int(match["s"]), match["offset"]
    offset_ok = len(offset) == 1 or (int(offset[1:3]) <= 23 and int(offset[4:6]) <= 59)
    return hour <= 23 and minute <= 59 and second <= 60 and offset_ok  # 60: a leap second


def _short(text: str) -> str:
    return text if len(text) <= _VIOLATION_CHARS else text[: _VIOLATION_CHARS - 3] + "..."
