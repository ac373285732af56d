from __future__ import annotations

import pytest
from pydantic import ValidationError

from producer.models import GenerationRequest, GenerationResult


def test_prompt_xor_messages() -> None:
    with pytest.raises(ValidationError, match="exactly one of 'prompt' or 'messages'"):
        GenerationRequest()
    with pytest.raises(ValidationError, match="exactly one"):
        GenerationRequest(prompt="hi", messages=[{"role": "user", "content": "hi"}])
    assert GenerationRequest(prompt="hi").prompt == "hi"
    assert GenerationRequest(messages=[{"role": "user", "content": "hi"}]).messages is not None


@pytest.mark.parametrize("agent_id", ["", "../etc", "a/b", "a b", "x" * 201, "-lead", "ağ"])
def test_agent_id_is_a_safe_name(agent_id: str) -> None:
    with pytest.raises(ValidationError, match="agent_id"):
        GenerationRequest(agent_id=agent_id, prompt="hi")


@pytest.mark.parametrize("agent_id", ["a", "agent-1", "team.alpha_2", "user:42:agent", "A" * 200])
def test_agent_id_accepts_ordinary_names(agent_id: str) -> None:
    assert GenerationRequest(agent_id=agent_id, prompt="hi").agent_id == agent_id


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", 10**6),
        ("temperature", -0.1),
        ("top_p", 0),
        ("top_p", 1.5),
        ("seed", -1),
        ("stop", [""]),
        ("metadata", {"x": object()}),
        ("retries", -1),
        ("job_timeout", 0),
        ("queue", "bad queue"),
    ],
)
def test_bad_values_are_rejected(field: str, value: object) -> None:
    with pytest.raises(ValidationError, match=field):
        GenerationRequest(prompt="hi", **{field: value})


def test_unknown_fields_are_rejected() -> None:
    with pytest.raises(ValidationError, match="max_token"):
        GenerationRequest.model_validate({"prompt": "hi", "max_token": 3})


def test_job_payload_leaves_queue_options_out() -> None:
    request = GenerationRequest(
        agent_id="a", prompt="hi", max_tokens=5, queue="other", retries=2, job_timeout=10, metadata={"k": 1}
    )
    payload = request.job_payload()
    assert payload == {
        "agent_id": "a",
        "prompt": "hi",
        "max_tokens": 5,
        "temperature": 0.0,
        "top_p": 1.0,
        "stop": [],
        "metadata": {"k": 1},
    }
    assert GenerationRequest.model_validate(payload).max_tokens == 5


def test_result_round_trips_through_json() -> None:
    result = GenerationResult(
        job_id="j",
        agent_id=None,
        text="Paris.",
        token_ids=[1, 2],
        finish_reason="stop",
        usage={"prompt_tokens": 3, "reused_tokens": 0, "prefilled_tokens": 3, "generated_tokens": 2},
        timings={"queued_s": 0.01, "time_to_first_token_s": 0.2, "total_s": 0.3},
    )
    assert GenerationResult.model_validate_json(result.model_dump_json()) == result
