"""The final validation of a response_format answer, and the job result carrying it. No model, no Redis."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any, cast

import pytest

from engine.core.params import OutputGrammar
from engine.core.results import Completion, Usage
from producer.models import GenerationRequest, GenerationResult
from worker.loop.held import HeldJob
from worker.loop.results import build_result
from worker.requests.logprobs import LogprobFormatter
from worker.requests.sampling import sampling_of
from worker.requests.schema_check import schema_check

DATES = {
    "type": "object",
    "properties": {
        "when": {"type": "string", "format": "date"},
        "at": {"type": "string", "format": "date-time"},
    },
}
UNIQUE_PAIR = {"type": "array", "items": {"const": "a"}, "minItems": 2, "maxItems": 2, "uniqueItems": True}


def schema_grammar(schema: dict[str, Any]) -> OutputGrammar:
    return OutputGrammar("json_schema", json.dumps(schema), "test schema")


def test_no_grammar_or_a_lark_one_has_no_schema_check() -> None:
    assert schema_check(None, "{}") is None
    assert schema_check(OutputGrammar("lark", 'start: "a"'), "a") is None


def test_an_answer_breaking_an_unenforced_keyword_is_reported_with_the_keyword() -> None:
    check = schema_check(schema_grammar(UNIQUE_PAIR), '["a", "a"]')
    assert check is not None and not check.valid
    assert check.violation is not None and "uniqueItems" in check.violation
    assert check.unenforced == ['Unimplemented keys: ["uniqueItems"]']


@pytest.mark.parametrize(
    ("answer", "where"),
    [
        ('{"when": "2024-13-45"}', "format"),  # the format checker is on
        ('{"at": "2024-01-02 10:00:00"}', "date-time"),  # checked here: jsonschema needs a package for it
        ('{"when": "2024-01-02"', "not JSON"),  # cut by max_tokens
        ('{"when": 5}', "at /when"),
    ],
)
def test_a_violation_says_where_and_why(answer: str, where: str) -> None:
    check = schema_check(schema_grammar(DATES), answer)
    assert check is not None and not check.valid and check.violation is not None
    assert where in check.violation


def test_rfc_3339_date_times_pass() -> None:
    for at in ("2024-01-02T10:00:00Z", "2024-01-02t10:00:00.5+05:30", "2016-12-31T23:59:60Z"):
        check = schema_check(schema_grammar(DATES), json.dumps({"at": at, "when": "2024-01-02"}))
        assert check is not None and check.valid, at


def test_a_valid_answer_is_valid_and_a_schema_the_validator_cannot_apply_is_never_called_valid() -> None:
    check = schema_check(schema_grammar(UNIQUE_PAIR), '["a"]')
    assert check is not None and not check.valid  # minItems: a violation the grammar would enforce
    good = schema_check(schema_grammar({"type": "object"}), ' {"x": 1}')
    assert good is not None and good.valid and good.violation is None and good.unenforced == []
    remote = schema_check(schema_grammar({"$ref": "https://example.com/elsewhere.json"}), "{}")
    assert remote is not None and not remote.valid
    assert remote.violation is not None and "could not be checked" in remote.violation


def test_the_job_result_carries_the_check_and_keeps_its_finish_reason() -> None:
    request = GenerationRequest.model_validate(
        {
            "prompt": "Two letters:",
            "max_tokens": 8,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "pair", "schema": UNIQUE_PAIR},
            },
        }
    )
    held = HeldJob(
        job=cast(Any, SimpleNamespace(id="job-1")),
        queue=cast(Any, None),
        execution=cast(Any, None),
        request=request,
        sampling=sampling_of(request),
        prompt_tokens=[1, 2],
        enqueued_at=1.0,
        first_enqueued_at=1.0,
        held_at=0.0,
    )
    completion = Completion(
        uid=1,
        agent_id=None,
        text='["a", "a"]',
        token_ids=[5, 6, 7],
        finish_reason="stop",
        usage=Usage(prompt_tokens=2, reused_tokens=0, prefilled_tokens=2, generated_tokens=3),
        cache=None,
    )
    formatter = cast(LogprobFormatter, None)
    result = GenerationResult.model_validate(
        build_result(held, completion, model="m", worker="w", logprobs=formatter)
    )
    assert result.finish_reason == "stop"
    assert result.schema_check is not None and not result.schema_check.valid
    assert result.schema_check.violation is not None and "uniqueItems" in result.schema_check.violation
