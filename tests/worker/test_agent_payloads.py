"""Agent fields sent with plain rq (no kvrq producer to check them first): each bad value fails its job
as invalid_request with a reason naming the field, when the worker takes it, before it waits for a slot."""

from __future__ import annotations

from typing import Any

import pytest
from rq import Queue
from rq.serializers import JSONSerializer

from producer.client import JobFailedError
from producer.wire.protocol import JOB_FUNCTION, ErrorCode
from tests.worker.harness import Harness

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"top_k": -1}, "top_k"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "invalid JSON schema",
        ),
        ({"logit_bias": {"x": 1}}, "logit_bias keys are token ids"),
        ({"logit_bias": {"999999": 1}}, "logit_bias token id 999999 is outside the vocabulary"),
        ({"top_logprobs": 3}, "top_logprobs needs logprobs"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "'g', which is not among the tools offered",
        ),
    ],
)
def test_bad_agent_fields_fail_their_job_as_invalid_request(fields: dict[str, Any], named: str) -> None:
    h = Harness()
    h.engine.vocab_size = 1000
    job = Queue("kvrq", connection=h.redis, serializer=JSONSerializer).enqueue(
        JOB_FUNCTION, {**CHAT, **fields}
    )
    handle = h.producer.handle(job.id)
    h.run_until(h.all_ended([handle]))
    with pytest.raises(JobFailedError) as failed:
        handle.result(timeout=1)
    assert failed.value.code == ErrorCode.INVALID_REQUEST and named in failed.value.reason
    assert failed.value.reason.startswith("JobRejected: invalid request: ")  # refused when taken
    assert h.engine.submitted == []  # never reached the engine
