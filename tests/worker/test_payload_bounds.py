"""What a job payload may cost a worker, and what it may not choose, checked with plain rq payloads.

A worker on fakeredis with a fake engine (tests/worker/harness.py): oversized prompts, messages and
job data fail with a reason naming what was too large, before the tokenizer sees them and without
touching the payload stored in Redis; fields that would pick the model, the store or the queue fail.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import ValidationError
from rq import Queue
from rq.serializers import JSONSerializer

from producer.client import JobFailedError, JobHandle
from producer.models import MAX_MESSAGES, MAX_METADATA_BYTES, MAX_PROMPT_CHARS, GenerationRequest
from producer.wire.protocol import JOB_FUNCTION, ErrorCode
from tests.worker.fakes import FakeTokenizer
from tests.worker.harness import Harness
from worker.jobs.bounded_job import MAX_JOB_DATA_BYTES, BoundedJob, data_size_problem


class CountingTokenizer(FakeTokenizer):
    """The fake tokenizer, remembering the longest text it was given."""

    def __init__(self) -> None:
        self.longest = 0

    def encode(self, text: str) -> list[int]:
        self.longest = max(self.longest, len(text))
        return super().encode(text)


@pytest.fixture
def h() -> Iterator[Harness]:
    harness = Harness()
    harness.engine.tokenizer = CountingTokenizer()
    yield harness


def plain_rq(h: Harness, *args: Any, **kwargs: Any) -> JobHandle:
    """Enqueue with rq alone; `kwargs` become the job's keyword arguments, never rq's own options."""
    queue = Queue("kvrq", connection=h.redis, serializer=JSONSerializer)
    job = queue.enqueue_call(JOB_FUNCTION, args=args, kwargs=kwargs)
    return h.producer.handle(job.id)


def failure(h: Harness, handle: JobHandle) -> JobFailedError:
    h.run_until(h.all_ended([handle]))
    with pytest.raises(JobFailedError) as info:
        handle.result(timeout=1)
    return info.value


def test_a_10_mb_prompt_fails_naming_the_field_before_tokenizing(h: Harness) -> None:
    handle = plain_rq(h, {"prompt": "a" * 10_000_000, "max_tokens": 2})
    error = failure(h, handle)
    assert error.code == ErrorCode.INVALID_REQUEST
    assert error.reason.startswith(
        f"JobRejected: invalid request: prompt: String should have at most {MAX_PROMPT_CHARS}"
    )
    assert h.engine.tokenizer.longest == 0  # type: ignore[attr-defined]


def test_messages_are_bounded_in_all_not_only_one_by_one(h: Harness) -> None:
    """Each message under the prompt limit, together over it: rejected before the chat template."""
    message = {"role": "user", "content": "b" * 900_000}
    handle = plain_rq(h, {"messages": [message] * 3, "max_tokens": 2})
    error = failure(h, handle)
    assert error.code == ErrorCode.INVALID_REQUEST
    assert "messages: Value error, messages hold 2,700,000 characters in all, the limit is 1,000,000" in (
        error.reason
    )
    assert h.engine.tokenizer.longest == 0  # type: ignore[attr-defined]


def test_messages_at_the_limit_in_all_are_valid() -> None:
    half = MAX_PROMPT_CHARS // 2
    messages = [{"role": "user", "content": "x" * half}, {"role": "user", "content": "y" * half}]
    assert GenerationRequest.model_validate({"messages": messages}).messages is not None
    with pytest.raises(ValidationError, match="in all"):
        GenerationRequest.model_validate({"messages": [*messages, {"role": "user", "content": "z"}]})


def test_job_data_over_the_bound_fails_unread_and_stays_stored(h: Harness) -> None:
    """17 MB of JSON that rq keeps as 17 KB of zlib: the worker refuses to inflate it, and keeps it."""
    bomb = plain_rq(h, {"prompt": "a" * (MAX_JOB_DATA_BYTES + 1024)})
    good = h.producer.submit({"prompt": "fine", "max_tokens": 2})
    stored = h.redis.hget(bomb.job().key, "data")
    assert stored is not None and len(stored) < 100_000
    error = failure(h, bomb)
    assert error.code == ErrorCode.INVALID_REQUEST
    assert error.reason == (
        "JobRejected: the job's data (its arguments as JSON) is over 16,777,216 bytes; a kvrq worker loads "
        "at most 16,777,216 bytes (a request's prompt or messages hold at most 1,000,000 characters)"
    )
    assert h.redis.hget(bomb.job().key, "data") == stored  # the failed job keeps its payload
    h.run_until(h.all_ended([good]))
    assert good.result(timeout=1).text == "ab"  # the worker went on
    assert h.engine.tokenizer.longest == len("fine")  # type: ignore[attr-defined]


def test_data_size_problem_bounds_stored_and_inflated_size() -> None:
    limit = 1000
    assert data_size_problem(zlib.compress(b"x" * limit), limit) is None
    assert data_size_problem(b"x" * limit, limit) is None  # rq also reads uncompressed data
    assert "over 1,000 bytes" in (data_size_problem(zlib.compress(b"x" * (limit + 1)), limit) or "")
    assert "1,001 bytes stored" in (data_size_problem(b"x" * (limit + 1), limit) or "")


def test_the_largest_valid_request_fits_the_job_data_bound() -> None:
    """Worst case for JSON size: astral characters (12 bytes escaped) everywhere a string may be long."""
    astral = "\U0001f600"
    per_message = MAX_PROMPT_CHARS // MAX_MESSAGES
    request = GenerationRequest.model_validate(
        {
            "agent_id": "a" * 200,
            "messages": [{"role": "r" * 32, "content": astral * per_message}] * MAX_MESSAGES,
            "stop": [astral * 256] * 16,
            "metadata": {"k": astral * ((MAX_METADATA_BYTES - 20) // 12)},
        }
    )
    prompt = GenerationRequest.model_validate({"prompt": astral * MAX_PROMPT_CHARS, "stop": request.stop})
    for payload in (request.job_payload(), prompt.job_payload()):
        data = JSONSerializer.dumps((JOB_FUNCTION, None, [payload], {}))
        assert len(data) < MAX_JOB_DATA_BYTES
    assert len(json.dumps(request.job_payload())) > 12_000_000  # the case is really near the worst


def test_bounded_job_loads_ordinary_jobs_as_rq_does(h: Harness) -> None:
    handle = plain_rq(h, {"prompt": "hi", "max_tokens": 2})
    job = BoundedJob.fetch(handle.id, connection=h.redis, serializer=JSONSerializer)
    assert isinstance(job, BoundedJob) and job.data_problem is None
    assert job.args == [{"prompt": "hi", "max_tokens": 2}]


@pytest.mark.parametrize(
    ("payload", "named"),
    [
        ({"prompt": "hi", "model": "other-model"}, "model: Extra inputs are not permitted"),
        ({"prompt": "hi", "store": "disk:/etc"}, "store: Extra inputs are not permitted"),
        ({"prompt": "hi", "store_uri": "redis://elsewhere:6379/0"}, "store_uri: Extra inputs"),
        ({"prompt": "hi", "redis_url": "redis://elsewhere:6379/0"}, "redis_url: Extra inputs"),
        ({"prompt": "hi", "queue": "kvrq~other-worker"}, "queue: rq options, not request fields"),
        ({"prompt": "hi", "job_timeout": 99999, "retries": 50}, "job_timeout, retries: rq options"),
        ({"prompt": "hi", "metadata": {}, "at_front": True}, "at_front: rq options"),
    ],
)
def test_a_payload_cannot_choose_model_store_or_queue(
    h: Harness, payload: dict[str, Any], named: str
) -> None:
    for handle in (plain_rq(h, payload), plain_rq(h, **payload)):
        error = failure(h, handle)
        assert error.code == ErrorCode.INVALID_REQUEST
        assert named in error.reason
    assert h.engine.submitted == []  # nothing reached the engine


def test_a_producer_request_cannot_name_another_workers_own_queue() -> None:
    with pytest.raises(ValidationError, match="queue"):
        GenerationRequest(prompt="hi", queue="kvrq~kvrq.host.1.abcd")  # a worker's own queue (affinity)
