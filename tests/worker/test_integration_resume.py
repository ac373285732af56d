"""Resume through the whole worker path, on two real workers sharing one Redis store.

Two `kvrq worker` processes (builtin SmolLM2), each serving its own queue, both with
`--store redis`: an agent's turns can be sent to either, so a turn that lands on the other
worker must resume from the cache the first one wrote (the agent's lock is released only once
that cache is durable in Redis). And a resumed answer must equal the answer the same prompt
gets with no cache at all, token for token.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from producer.client import JobHandle, Producer
from producer.models import GenerationResult
from tests.worker.procs import RedisProcess, WorkerProcess, module_redis, worker_per_queue

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.mlx_path]

SYSTEM = "You are a concise assistant. Answer in one short sentence."
QUESTIONS = ["Name a colour.", "Name a fruit of that colour.", "Is it sweet?", "Name an animal."]


redis_proc = module_redis("resume")


@pytest.fixture(scope="module")
def workers(
    redis_proc: RedisProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[WorkerProcess]]:
    args = ["--store", "redis", "--max-batch", "4"]
    with worker_per_queue(redis_proc.url, tmp_path_factory, "resume", ("qa", "qb"), args) as procs:
        yield procs


@pytest.fixture
def producer(redis_proc: RedisProcess, workers: list[WorkerProcess]) -> Iterator[Producer]:
    with Producer(redis_proc.url, affinity=False) as p:
        yield p


def messages(history: list[tuple[str, str]], question: str) -> list[dict[str, str]]:
    chat = [{"role": "system", "content": SYSTEM}]
    for asked, answered in history:
        chat += [{"role": "user", "content": asked}, {"role": "assistant", "content": answered}]
    return chat + [{"role": "user", "content": question}]


def ask(producer: Producer, queue: str, chat: list[dict[str, str]], agent: str | None, **extra: Any) -> Any:
    handle = producer.submit({"agent_id": agent, "messages": chat, "max_tokens": 10, "queue": queue, **extra})
    return handle.result(timeout=300)


def test_an_agent_alternating_between_workers_resumes_every_turn(producer: Producer) -> None:
    history: list[tuple[str, str]] = []
    covered = 0  # tokens the previous turn's cache holds: its prompt + answer
    for turn, question in enumerate(QUESTIONS):
        queue = ("qa", "qb")[turn % 2]
        result = ask(producer, queue, messages(history, question), "alternating")
        assert result.worker == f"kvrq-resume-{queue}"
        if turn:
            assert result.usage.reused_tokens >= 0.95 * covered, (turn, result.usage, covered)
        covered = result.usage.prompt_tokens + result.usage.generated_tokens
        history.append((question, result.text))


def test_a_resumed_answer_equals_the_answer_without_cache(producer: Producer) -> None:
    first = ask(producer, "qa", messages([], QUESTIONS[0]), "parity")
    second_chat = messages([(QUESTIONS[0], first.text)], QUESTIONS[1])
    resumed = ask(producer, "qb", second_chat, "parity")  # the other worker, from the Redis store
    # The reference prefills it all: a namespace of its own, so no cache of parity's (kept whole in the
    # worker's recent prefixes) can serve it.
    fresh = ask(producer, "qb", second_chat, None, namespace="reference")
    assert resumed.usage.reused_tokens > 0 and fresh.usage.reused_tokens == 0
    assert resumed.token_ids == fresh.token_ids


def test_a_prompt_the_cache_fully_covers_and_a_one_token_suffix(producer: Producer) -> None:
    prompt = "The three primary colours are"
    first = producer.submit({"agent_id": "cover", "prompt": prompt, "max_tokens": 8, "queue": "qa"})
    answer = first.result(timeout=300)
    again = producer.submit({"agent_id": "cover", "prompt": prompt, "max_tokens": 8, "queue": "qa"})
    covered = again.result(timeout=300)
    assert covered.usage.prefilled_tokens == 1  # all but the last prompt token came from the cache
    fresh = producer.submit({"prompt": prompt, "max_tokens": 8, "queue": "qa"}).result(timeout=300)
    assert covered.token_ids == fresh.token_ids == answer.token_ids
    longer = prompt + answer.text + "\n"
    suffixed = producer.submit({"agent_id": "cover", "prompt": longer, "max_tokens": 8, "queue": "qb"})
    resumed = suffixed.result(timeout=300)
    assert resumed.usage.prefilled_tokens <= 2, resumed.usage  # the new line (and a re-split edge)
    fresh = producer.submit({"prompt": longer, "max_tokens": 8, "queue": "qb"}).result(timeout=300)
    assert resumed.token_ids == fresh.token_ids


def test_a_resume_joining_a_batch_already_decoding(producer: Producer) -> None:
    first = ask(producer, "qa", messages([], QUESTIONS[3]), "joiner")
    second_chat = messages([(QUESTIONS[3], first.text)], QUESTIONS[2])
    story = "Once upon a time, in a small village by the sea,"  # raw text: runs on, no chat turn to end
    long_jobs = [{"prompt": story + " " * i, "max_tokens": 120, "queue": "qa"} for i in range(2)]
    busy = [producer.submit(job) for job in long_jobs]
    for handle in busy:
        next(e for e in handle.events(timeout=300) if e.kind == "delta")  # both are decoding
    joined = producer.submit({"agent_id": "joiner", "messages": second_chat, "max_tokens": 10, "queue": "qa"})
    resumed = joined.result(timeout=300)
    assert resumed.usage.reused_tokens > 0
    for handle in busy:
        done = handle.result(timeout=300)
        assert ended_at(handle, done) > ended_at(joined, resumed)  # still decoding: the resume joined them
    fresh = ask(producer, "qa", second_chat, None)
    assert resumed.token_ids == fresh.token_ids


def ended_at(handle: JobHandle, result: GenerationResult) -> float:
    enqueued = handle.job().enqueued_at
    assert enqueued is not None
    return enqueued.timestamp() + result.timings.total_s
