"""Quantized KV in the pool (`--kv-bits 8`) through the whole worker path, on real workers.

Two `kvrq worker` processes (builtin SmolLM2) share one Redis store: one holds its pool at 8 bits,
the other at full precision. An agent alternating between them must resume every turn from the
cache the other one saved: a quantized pool's cache read back into a float pool and the other way.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from producer.client import Producer
from tests.worker.procs import RedisProcess, module_redis, worker_per_queue

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SYSTEM = "You are a concise assistant. Answer in one short sentence."
QUESTIONS = ["Name a colour.", "Name a fruit of that colour.", "Is it sweet?"]


redis_proc = module_redis("kv-bits")


@pytest.fixture(scope="module")
def workers(redis_proc: RedisProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    args = ["--store", "redis", "--max-batch", "2"]
    extra = {"q8": ["--kv-bits", "8"]}
    with worker_per_queue(redis_proc.url, tmp_path_factory, "kvbits", ("q8", "fp"), args, extra):
        yield


def test_an_agent_alternating_between_a_q8_pool_and_a_float_pool_resumes_every_turn(
    redis_proc: RedisProcess, workers: None
) -> None:
    history: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    covered = 0  # tokens the previous turn's cache holds: its prompt + answer
    with Producer(redis_proc.url, affinity=False) as producer:
        for turn, question in enumerate(QUESTIONS):
            queue = ("q8", "fp")[turn % 2]
            history.append({"role": "user", "content": question})
            handle = producer.submit(
                {"agent_id": "kv-bits", "messages": history, "max_tokens": 8, "queue": queue}
            )
            result = handle.result(timeout=300)
            assert result.worker == f"kvrq-kvbits-{queue}"
            assert result.text.strip(), (turn, result)
            if turn:  # the cache the other pool saved was read back, converted once, and used
                assert result.usage.reused_tokens >= 0.95 * covered, (turn, result.usage, covered)
            covered = result.usage.prompt_tokens + result.usage.generated_tokens
            history.append({"role": "assistant", "content": result.text})
