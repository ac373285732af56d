"""`previous_response_id` and `conversation` on the real worker and model: a follow-up sends only its new
input and resumes the previous response's KV, two follow-ups of one response branch, a conversation's
second turn resumes its first, and the KV follows the conversation to another worker after the first
one stopped (the store and the records outlive any process)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.http.test_integration import MODEL, ServeProcess
from tests.worker.procs import RedisProcess, WorkerProcess, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
def workdir(tmp_path: Path) -> Iterator[tuple[Path, RedisProcess, ServeProcess]]:
    redis = RedisProcess(tmp_path)
    redis.start()
    server = ServeProcess(redis.url, tmp_path)
    try:
        yield tmp_path, redis, server
    finally:
        server.stop()
        redis.stop()


def test_follow_ups_resume_the_previous_response_on_any_worker(
    workdir: tuple[Path, RedisProcess, ServeProcess],
) -> None:
    path, redis, server = workdir
    first_worker = WorkerProcess(redis.url, path, name="responses-a").start()
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        wait_for(lambda: server.serves(MODEL), 60, "kvrq serve does not list the model")
        first = client.responses.create(
            model=MODEL,
            instructions="You are a helpful assistant.",
            input="What is the capital of France?",
            max_output_tokens=8,
            temperature=0,
        )
        assert first.usage is not None and first.output_text
        branches = []
        for words in ("And of Spain?", "And of Italy?"):
            events = list(
                client.responses.create(
                    model=MODEL,
                    input=words,
                    previous_response_id=first.id,
                    max_output_tokens=6,
                    stream=True,
                    temperature=0,
                )
            )
            assert events[-1].type in (
                "response.completed",
                "response.incomplete",
            )  # cut by max_output_tokens
            branches.append(events[-1].response)
        for branch in branches:  # each resumed all of the first turn: its prompt and its answer
            assert branch.usage is not None
            assert branch.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
            assert branch.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
        conversation = client.conversations.create(
            items=[{"type": "message", "role": "user", "content": "My name is Ada."}]
        )
        turns = [
            client.responses.create(
                model=MODEL, conversation=conversation.id, input=words, max_output_tokens=4, temperature=0
            )
            for words in ("Hello!", "What is my name?")
        ]
        assert turns[0].usage is not None and turns[1].usage is not None
        assert turns[1].usage.input_tokens_details.cached_tokens >= turns[0].usage.input_tokens
        items = client.conversations.items.list(conversation.id, order="asc").data
        assert len(items) == 5  # the item it began with, then each turn's input and answer
    finally:
        first_worker.terminate()
    second_worker = WorkerProcess(redis.url, path, name="responses-b").start()
    try:
        wait_for(lambda: server.serves(MODEL), 60, "kvrq serve does not list the second worker's model")
        later = client.responses.create(
            model=MODEL,
            input="And of Germany?",
            previous_response_id=branches[0].id,
            max_output_tokens=4,
            temperature=0,
        )
        assert later.usage is not None and branches[0].usage is not None
        assert later.usage.input_tokens_details.cached_tokens >= branches[0].usage.input_tokens
        assert later.model_dump()["kvrq"]["worker"] == "responses-b"
    finally:
        second_worker.stop()
