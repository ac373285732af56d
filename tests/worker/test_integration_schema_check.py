"""response_format through a real worker and the builtin model: a schema with a keyword the grammar cannot
hold runs (it used to be refused), and the job's result says whether the answer keeps the whole schema."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from producer.client import Producer
from tests.worker.procs import RedisProcess, WorkerProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow]

#: The grammar holds the answer to two "a"s; only uniqueItems, which it cannot enforce, forbids that.
UNIQUE_PAIR = {"type": "array", "items": {"const": "a"}, "minItems": 2, "maxItems": 2, "uniqueItems": True}
FLAG = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}


def schema_request(name: str, schema: dict[str, object]) -> dict[str, object]:
    return {
        "messages": [{"role": "user", "content": "Answer in JSON."}],
        "max_tokens": 32,
        "response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema}},
    }


def test_an_unenforced_keyword_broken_is_reported_and_an_enforced_schema_is_valid(
    producer: Producer, redis_proc: RedisProcess, tmp_path: Path
) -> None:
    worker = WorkerProcess(redis_proc.url, tmp_path, name="kvrq-schema-check")
    worker.start()
    try:
        pair = producer.submit(schema_request("pair", UNIQUE_PAIR)).result(timeout=300)
        flag = producer.submit(schema_request("flag", FLAG)).result(timeout=300)
    finally:
        assert worker.terminate() == 0, worker.log()
    assert pair.finish_reason == "stop" and json.loads(pair.text) == ["a", "a"]
    assert pair.schema_check is not None and not pair.schema_check.valid
    assert pair.schema_check.violation is not None and "uniqueItems" in pair.schema_check.violation
    assert pair.schema_check.unenforced == ['Unimplemented keys: ["uniqueItems"]']
    assert flag.finish_reason == "stop"
    assert flag.schema_check is not None and flag.schema_check.valid and flag.schema_check.unenforced == []
