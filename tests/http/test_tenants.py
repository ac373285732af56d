"""Tenants are walls (issue 40), proven on a real stack: redis-server, a `kvrq worker` on the builtin
model and `kvrq serve` with two tenants' keys. Tenant "acme" has two keys (a rotation: both reach the
same agents); the bare key B is a tenant of its own. B names A's agent (continue, fork_from, the same
agent id and prompt) and sends A's prompts: it sees nothing of A's, in tokens, reuse or answer. The
Producer, batch runs and the operator's views get the same wall."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis import Redis

from producer.batch import run_batch
from producer.client import Producer
from producer.tenants import key_tenant
from tests.http.test_integration import MODEL, ServeProcess
from tests.worker.procs import ROOT, RedisProcess, WorkerProcess, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

KEY_A, KEY_A2, KEY_B = "sk-acme-1", "sk-acme-2", "sk-bare-b"
SECRET = "The vault code is 4417-AZURE. Remember it."


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, str, Path]]:
    workdir = tmp_path_factory.mktemp("tenants")
    keys = workdir / "keys"
    keys.write_text(f"# two keys of one tenant, and a bare key\n{KEY_A} acme\n{KEY_A2} acme\n{KEY_B}\n")
    redis = RedisProcess(workdir)
    redis.start()
    worker = WorkerProcess(redis.url, workdir, name="tenants-worker")
    server = ServeProcess(redis.url, workdir, ["--api-key-file", str(keys)])
    try:
        worker.start()
        wait_for(
            lambda: server.serves(MODEL) or server.proc.poll() is not None, 60, "kvrq serve did not start"
        )
        assert server.proc.poll() is None, server.log()
        yield server, redis.url, workdir / "cache"
    finally:
        server.stop()
        worker.stop()
        redis.stop()


def chat(server: ServeProcess, key: str, content: str, **fields: Any) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4, **fields}
    return post(server, key, "/v1/chat/completions", body)


def complete(server: ServeProcess, key: str, prompt: str) -> httpx.Response:
    """A raw prompt (no chat template whose head every earlier request of the tenant shares)."""
    return post(server, key, "/v1/completions", {"prompt": prompt, "max_tokens": 4})


def post(server: ServeProcess, key: str, path: str, body: dict[str, Any]) -> httpx.Response:
    body = {"model": MODEL, "temperature": 0, **body}
    headers = {"authorization": f"Bearer {key}"}
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=120)


def usage(answer: httpx.Response) -> tuple[int, int]:
    """(prompt tokens, tokens reused from a cache) of a 200 answer."""
    assert answer.status_code == 200, answer.text
    body = answer.json()
    return body["usage"]["prompt_tokens"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_another_tenant_continuing_or_forking_the_same_agent_sees_nothing(
    stack: tuple[ServeProcess, str, Path],
) -> None:
    server = stack[0]
    agent, memory = "shared-agent", {"kvrq": {"continue": True}}
    first = chat(server, KEY_A, SECRET, prompt_cache_key=agent, **memory)
    a_first, _ = usage(first)
    assert first.json()["kvrq"]["agent_id"] == agent  # the client's own id, never the qualified one
    a_second, a_reused = usage(chat(server, KEY_A2, "Repeat the code.", prompt_cache_key=agent, **memory))
    assert a_second > a_first and a_reused >= a_first  # acme's other key continues acme's agent

    forked = chat(server, KEY_B, "Repeat the code.", prompt_cache_key="b-fork", kvrq={"fork_from": agent})
    assert forked.status_code == 400, forked.text  # B has no agent of that name
    message = forked.json()["error"]["message"]
    assert (
        f"'{agent}'" in message
        and key_tenant(KEY_B) not in message
        and "acme" not in message
        and "4417" not in message
    )

    b_answer = chat(server, KEY_B, "Repeat the code.", prompt_cache_key=agent, max_tokens=16, **memory)
    b_prompt, b_reused = usage(b_answer)
    assert b_reused == 0  # nothing of A's conversation came from a cache
    assert "4417" not in b_answer.json()["choices"][0]["message"]["content"]
    assert b_answer.json()["kvrq"]["agent_id"] == agent
    alone, _ = usage(chat(server, KEY_B, "Repeat the code."))  # the same turn, with no history at all
    assert b_prompt == alone and b_prompt < a_second  # B's conversation holds B's turn only

    # Plain agent jobs (no continue), the same id and prompt: B resumes none of A's cache, then its own.
    a_plain, _ = usage(chat(server, KEY_A, SECRET, prompt_cache_key="a-plain"))
    assert usage(chat(server, KEY_A, SECRET, prompt_cache_key="a-plain"))[1] == a_plain - 1
    assert usage(chat(server, KEY_B, SECRET, prompt_cache_key="a-plain"))[1] == 0
    assert usage(chat(server, KEY_B, SECRET, prompt_cache_key="a-plain"))[1] == a_plain - 1


def test_identical_prompts_reuse_only_their_own_tenants_prefix(stack: tuple[ServeProcess, str, Path]) -> None:
    server = stack[0]
    # Over two 256-token blocks: the store's shared blocks and the worker's recent prefixes both apply.
    prompt = f"{secrets.token_hex(8)} report. " + " ".join(
        f"Line {i} of the quarterly figures." for i in range(90)
    )
    total, reused = usage(complete(server, KEY_A, prompt))
    assert total > 512 and reused == 0
    assert usage(complete(server, KEY_A2, prompt))[1] >= 512  # acme reuses its own (through its other key)
    assert usage(complete(server, KEY_B, prompt))[1] == 0  # B's first: none of acme's, although acme sent it
    assert usage(complete(server, KEY_B, prompt))[1] >= 512  # B's second: B's own


def kvrq_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "worker.cli", *args], capture_output=True, text=True, cwd=ROOT, timeout=120
    )


def test_agent_and_cache_views_show_one_tenants_agents_by_their_client_ids(
    stack: tuple[ServeProcess, str, Path],
) -> None:
    server, redis_url, cache = stack
    chat(server, KEY_A, SECRET, prompt_cache_key="view-agent", kvrq={"continue": True})
    chat(server, KEY_B, "Hello.", prompt_cache_key="b-view")
    store = f"disk:{cache}"
    shown = kvrq_cli(
        "agent", "show", "view-agent", "--tenant", "acme", "--redis", redis_url, "--store", store
    )
    assert shown.returncode == 0 and "agent view-agent" in shown.stdout and "4417" in shown.stdout, (
        shown.stderr
    )
    theirs = kvrq_cli(
        "agent", "show", "view-agent", "--tenant", key_tenant(KEY_B), "--redis", redis_url, "--store", store
    )
    assert theirs.returncode == 1 and "4417" not in theirs.stdout
    wait_for(
        lambda: "view-agent" in kvrq_cli("cache", "--store", store, "--tenant", "acme", "list").stdout,
        30,
        "no put",
    )
    listed = kvrq_cli("cache", "--store", store, "--tenant", "acme", "list").stdout
    assert "t:acme:" not in listed and "b-view" not in listed
    wait_for(
        lambda: "b-view" in kvrq_cli("cache", "--store", store, "--tenant", key_tenant(KEY_B), "list").stdout,
        30,
        "no put",
    )
    b_listed = kvrq_cli("cache", "--store", store, "--tenant", key_tenant(KEY_B), "list").stdout
    assert "view-agent" not in b_listed and f"t:{key_tenant(KEY_B)}:" not in b_listed


def test_producer_and_batch_runs_get_the_same_wall(
    stack: tuple[ServeProcess, str, Path], tmp_path: Path
) -> None:
    server, redis_url, _ = stack
    connection = Redis.from_url(redis_url)
    chat(server, KEY_A, SECRET, prompt_cache_key="app-agent", kvrq={"continue": True})
    turn = {"agent_id": "app-agent", "continue": True, "max_tokens": 4, "temperature": 0.0}
    turn["messages"] = [{"role": "user", "content": "Repeat the code."}]
    mine = Producer(connection=connection, tenant="acme").submit(turn).result(timeout=120)
    assert mine.agent_id == "app-agent" and mine.usage.reused_tokens > 0  # acme's agent, through kvrq serve
    other = Producer(connection=connection, tenant="other").submit(turn).result(timeout=120)
    assert other.usage.reused_tokens == 0 and other.usage.prompt_tokens < mine.usage.prompt_tokens
    anyone = Producer(connection=connection).submit(turn).result(timeout=120)  # no tenant: today's space
    assert anyone.usage.prompt_tokens < mine.usage.prompt_tokens

    lines = tmp_path / "in.jsonl"
    line = {
        "custom_id": "c1",
        "method": "POST",
        "url": "/v1/completions",
        "kvrq": {"agent_id": "batch-agent"},
    }
    line["body"] = {"model": MODEL, "prompt": SECRET, "max_tokens": 2, "temperature": 0}
    lines.write_text(json.dumps(line) + "\n")
    summary = run_batch(lines, tmp_path / "out.jsonl", connection=connection, tenant="acme", progress=False)
    assert summary.state == "done", (tmp_path / "out.jsonl").read_text()
    (written,) = [json.loads(text) for text in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert written["kvrq"]["agent_id"] == "batch-agent" and "t:acme:" not in json.dumps(written)
    again = {"agent_id": "batch-agent", "prompt": SECRET + " Again.", "max_tokens": 2, "temperature": 0.0}
    assert (
        Producer(connection=connection, tenant="acme").submit(again).result(timeout=120).usage.reused_tokens
        > 0
    )
    assert (
        Producer(connection=connection, tenant="other").submit(again).result(timeout=120).usage.reused_tokens
        == 0
    )


def test_a_tenants_stored_responses_and_conversations_resume_inside_its_wall(
    stack: tuple[ServeProcess, str, Path],
) -> None:
    server = stack[0]

    def respond(key: str, **fields: Any) -> dict[str, Any]:
        answer = post(server, key, "/v1/responses", {"max_output_tokens": 4, **fields})
        assert answer.status_code == 200, answer.text
        return dict(answer.json())

    first = respond(KEY_A, input=SECRET)
    assert first["kvrq"]["agent_id"] == f"responses:{first['id']}"  # as the client would name it
    follow = respond(KEY_A2, input="Repeat the code.", previous_response_id=first["id"])
    assert follow["usage"]["input_tokens_details"]["cached_tokens"] >= first["usage"]["input_tokens"] - 1
    refused = post(
        server, KEY_B, "/v1/responses", {"input": "Repeat the code.", "previous_response_id": first["id"]}
    )
    assert refused.status_code == 400 and "4417" not in refused.text
    made = httpx.post(f"{server.url}/v1/conversations", json={}, headers={"x-api-key": KEY_A}, timeout=30)
    conversation = made.json()["id"]
    one = respond(KEY_A, input=SECRET, conversation=conversation)
    two = respond(KEY_A2, input="Repeat the code.", conversation=conversation)
    assert two["usage"]["input_tokens"] > one["usage"]["input_tokens"]
    assert two["usage"]["input_tokens_details"]["cached_tokens"] > 0
    assert (
        post(server, KEY_B, "/v1/responses", {"input": "x", "conversation": conversation}).status_code == 404
    )
