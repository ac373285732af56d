"""Agents that remember, through real `kvrq worker` processes (builtin SmolLM2) sharing a Redis store.

A `continue` turn sends only its new message; the worker renders the stored conversation + it and
resumes the KV the previous turn left, on either worker. Its answer must equal the answer a client
re-sending the whole history gets with no cache, token for token. A fork never changes its parent;
a turn whose worker is killed runs again once and is recorded once.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from producer.client import Producer
from producer.models import GenerationResult
from tests.worker.procs import ROOT, RedisProcess, WorkerProcess, module_redis, wait_for, worker_per_queue
from tests.worker.test_integration_crash import FAST_LIVENESS, generating, holder

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STORE_ARGS = ["--store", "redis", "--max-batch", "4"]
SYSTEM = {"role": "system", "content": "You are a concise assistant. Answer in one short sentence."}


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def answer(result: GenerationResult) -> dict[str, str]:
    return {"role": "assistant", "content": result.text}


shared_redis = module_redis("memory")


@pytest.fixture(scope="module")
def two_workers(shared_redis: RedisProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    with worker_per_queue(shared_redis.url, tmp_path_factory, "memory", ("qa", "qb"), STORE_ARGS):
        yield


@pytest.fixture
def client(shared_redis: RedisProcess, two_workers: None) -> Iterator[Producer]:
    with Producer(shared_redis.url, affinity=False) as p:
        yield p


def ask(producer: Producer, queue: str, **fields: Any) -> GenerationResult:
    return producer.submit({"max_tokens": 10, "queue": queue, **fields}).result(timeout=300)


def test_a_second_turn_sends_one_message_and_equals_the_full_history_answer(client: Producer) -> None:
    first = ask(client, "qa", agent_id="zed", messages=[SYSTEM, user("What is the capital of France?")])
    second = ask(client, "qb", agent_id="zed", messages=[user("And of Spain?")], **{"continue": True})
    assert second.usage.reused_tokens >= first.usage.prompt_tokens + first.usage.generated_tokens - 1
    history = [SYSTEM, user("What is the capital of France?"), answer(first), user("And of Spain?")]
    # The reference prefills it all: a namespace of its own, so no cache of zed's (kept whole in the
    # worker's recent prefixes since 86b3765) can serve it.
    fresh = ask(client, "qa", messages=history, namespace="reference")
    assert fresh.usage.reused_tokens == 0
    assert second.token_ids == fresh.token_ids
    assert client.conversation("zed") == [*history, answer(second)]


def test_a_fork_shares_its_parents_past_and_never_changes_its_future(client: Producer) -> None:
    root = ask(client, "qa", agent_id="trunk", messages=[SYSTEM, user("Name a colour.")])
    forks = [
        client.submit(
            {
                "agent_id": f"branch-{i}",
                "fork_from": "trunk",
                "messages": [user(q)],
                "max_tokens": 10,
                "queue": q_,
            }
        )
        for i, (q, q_) in enumerate(
            [("Name a fruit of that colour.", "qa"), ("Name a car of that colour.", "qb")]
        )
    ]
    for handle in forks:
        result = handle.result(timeout=300)
        assert result.usage.reused_tokens >= root.usage.prompt_tokens + root.usage.generated_tokens - 1
    trunk = ask(client, "qb", agent_id="trunk", messages=[user("Is it warm?")], **{"continue": True})
    history = [SYSTEM, user("Name a colour."), answer(root), user("Is it warm?")]
    assert trunk.token_ids == ask(client, "qa", messages=history).token_ids
    branch = client.conversation("branch-1") or []
    assert branch[:3] == history[:3] and branch[3] == user("Name a car of that colour.")


def test_kvrq_generate_remembers_and_agent_reset_forgets(
    client: Producer, shared_redis: RedisProcess
) -> None:
    def kvrq(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "worker.cli", *args]
        return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)

    common = ["--redis", shared_redis.url, "--queue", "qa", "--max-tokens", "8"]
    first = kvrq("generate", "--agent", "cli", *common, "What is the capital of France?")
    second = kvrq("generate", "--agent", "cli", *common, "And of Spain?")
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    first_prompt = int(first.stderr.split(" of ")[1].split()[0])
    reused = int(second.stderr.split("reused ")[1].split()[0])
    assert reused > first_prompt, (first.stderr, second.stderr)  # the whole first turn, not the template
    shown = kvrq("agent", "show", "cli", "--redis", shared_redis.url, "--store", "redis")
    assert shown.returncode == 0 and "messages: 4" in shown.stdout and "And of Spain?" in shown.stdout
    reset = kvrq("agent", "reset", "cli", "--redis", shared_redis.url, "--store", "redis")
    assert reset.returncode == 0, reset.stderr
    assert client.conversation("cli") is None
    again = kvrq("agent", "show", "cli", "--redis", shared_redis.url, "--store", "redis")
    assert again.returncode == 1 and "no conversation and no cache" in again.stderr


def test_a_turn_whose_worker_is_killed_runs_again_and_is_recorded_once(
    shared_redis: RedisProcess, tmp_path_factory: pytest.TempPathFactory
) -> None:
    workdir = tmp_path_factory.mktemp("memory-crash")
    workers = {
        name: WorkerProcess(
            shared_redis.url, workdir, name=name, queue="crashq", args=["--store", "redis"], env=FAST_LIVENESS
        )
        for name in ("kvrq-memory-c1", "kvrq-memory-c2")
    }
    try:
        for worker in workers.values():
            worker.start()
        with Producer(shared_redis.url, queue="crashq", affinity=False) as producer:
            first = producer.submit(
                {"agent_id": "phoenix", "messages": [SYSTEM, user("Name a bird.")], "max_tokens": 8}
            ).result(timeout=300)
            story = user("Tell me a long story about that bird, with many details.")
            turn = producer.submit(
                {"agent_id": "phoenix", "messages": [story], "max_tokens": 48, "continue": True}
            )
            wait_for(
                lambda: generating(producer.connection, turn.id), 120, "the turn never started generating"
            )
            running_on = holder(producer.connection, turn.id)
            assert running_on is not None
            workers[running_on].kill()
            result = turn.result(timeout=300)
            assert result.worker != running_on
            conversation = producer.conversation("phoenix") or []
            assert conversation == [SYSTEM, user("Name a bird."), answer(first), story, answer(result)]
    finally:
        for worker in workers.values():
            worker.stop()


LONG_SYSTEM = {
    "role": "system",
    "content": "You are a support assistant for a bicycle shop. "
    + " ".join(f"Rule {i}: answer politely and mention part number {1000 + i}." for i in range(40)),
}


def test_jobs_without_an_agent_reuse_a_prefix_across_workers(client: Producer) -> None:
    first = ask(client, "qa", messages=[LONG_SYSTEM, user("Do you sell bells?")])
    assert (
        first.usage.prompt_tokens > 512 and first.usage.reused_tokens < 256
    )  # the template's opening at most
    held = (first.usage.prompt_tokens + first.usage.generated_tokens - 1) // 256
    prefixes = "kvrq:cache:prefixes"  # written behind the result: wait until the store holds its blocks
    wait_for(lambda: client.connection.zcard(prefixes) >= held, 60, "the prefix was never stored")
    history = [LONG_SYSTEM, user("Do you sell bells?"), answer(first), user("And lights?")]
    second = ask(client, "qb", messages=history)  # the other worker, no agent id: the shared prefix
    assert second.usage.reused_tokens >= first.usage.prompt_tokens // 256 * 256 > 0  # every full block
    fresh = ask(client, "qb", messages=history, namespace="elsewhere")  # a tenant of its own: nothing
    assert fresh.usage.reused_tokens == 0
    assert second.token_ids == fresh.token_ids


def test_a_tenant_gets_no_token_of_another_tenants_identical_prefix(client: Producer) -> None:
    chat = [LONG_SYSTEM, user("Which tyres fit a city bike?")]
    ask(client, "qa", messages=chat, namespace="tenant-a", agent_id="a-1")
    lock = "kvrq:agent-lock:a-1"  # released once the agent's cache is durable in the store
    wait_for(lambda: not client.connection.exists(lock), 60, "a-1's cache was never saved")
    other = ask(client, "qb", messages=chat, namespace="tenant-b")
    same = ask(client, "qb", messages=chat, namespace="tenant-a")
    assert other.usage.reused_tokens == 0
    assert same.usage.reused_tokens >= 512
