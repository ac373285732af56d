"""max_tokens_fit (kvrq serve sets it): a max_tokens past what the context leaves is cut to it, on a
worker loop with the fake engine (fakeredis); a prompt that alone fills the context is still refused.
(tests/http/test_client_integration.py checks the real engine's message names both numbers.)"""

from __future__ import annotations

import pytest

from producer.client import JobFailedError
from tests.worker.harness import Harness

CONTEXT = 8  # the fake engine's context, small so the cut answer is short


@pytest.fixture
def h() -> Harness:
    harness = Harness()
    harness.engine.max_context = CONTEXT
    return harness


def test_max_tokens_past_the_context_is_cut_to_what_it_leaves(h: Harness) -> None:
    handle = h.producer.submit({"prompt": "x", "max_tokens": 32000, "max_tokens_fit": True})
    h.run_until(h.all_ended([handle]))
    result = handle.result(timeout=1)
    assert result.finish_reason == "length"
    assert result.usage.prompt_tokens + result.usage.generated_tokens == CONTEXT


def test_without_the_flag_it_is_refused_as_before(h: Harness) -> None:
    handle = h.producer.submit({"prompt": "x", "max_tokens": 32000})
    h.run_until(h.all_ended([handle]))
    with pytest.raises(JobFailedError, match=r"max_tokens \(32000\) exceeds the context"):
        handle.result(timeout=1)


def test_a_prompt_that_alone_fills_the_context_is_still_refused(h: Harness) -> None:
    handle = h.producer.submit({"prompt": "x" * (CONTEXT + 2), "max_tokens": 5, "max_tokens_fit": True})
    h.run_until(h.all_ended([handle]))
    with pytest.raises(JobFailedError) as failed:
        handle.result(timeout=1)
    assert failed.value.code == "context_length_exceeded"
    assert f"prompt ({CONTEXT + 2} tokens)" in failed.value.reason  # the fake engine's words
