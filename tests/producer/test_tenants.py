"""The tenant rule (producer/tenants.py) and every entry point that applies it, without a worker
(fakeredis): qualified agent ids and namespace in what is enqueued, the client's own ids in what comes
back, key files mapped to tenants, and the operator's views of one tenant."""

from __future__ import annotations

import argparse
import io
import threading
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from redis import Redis
from rq.job import Job

from producer.batch.driver import tenant_lines
from producer.batch.format import BadLine, BatchRequest
from producer.batch.run import derive_run_id
from producer.client import JobFailedError, Producer
from producer.http import pools
from producer.http.app import ServeSettings, create_app
from producer.http.guard import load_key_tenants, load_keys
from producer.http.pools import Pool
from producer.models import GenerationRequest
from producer.tenants import Tenant, key_tenant, tenant_of, tenant_problem
from producer.wire.ids import MAX_AGENT_ID_LENGTH
from producer.wire.protocol import ErrorCode, StreamEvent, stream_key
from tests.producer.fakes import app_connections, fail_like_rq, fake_redis, result_payload
from tests.producer.test_client import _finish_like_a_worker

CHAT = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_a_tenants_agent_ids_are_qualified_and_read_back_as_the_clients() -> None:
    acme = Tenant("acme")
    assert acme.agent("shared-agent") == "t:acme:shared-agent"
    assert Tenant("other").agent("shared-agent") != acme.agent("shared-agent")
    assert acme.own("t:acme:shared-agent") == "shared-agent"
    assert acme.own("t:other:shared-agent") is None and acme.own("shared-agent") is None
    assert acme.unqualified("agent 't:acme:x' has no conversation") == "agent 'x' has no conversation"
    # Tenant names have no ':', so a client's id cannot reach into another tenant's space.
    assert acme.agent("t:other:x") == "t:acme:t:other:x"
    assert tenant_problem("a:b") is not None and tenant_problem("") is not None
    assert tenant_problem("acme.prod-2") is None
    with pytest.raises(ValueError):
        Tenant("has space")


def test_a_client_id_must_leave_room_for_its_tenant_and_errors_name_only_the_clients_id() -> None:
    acme = Tenant("acme")
    longest = "a" * acme.max_agent_id
    assert len(acme.agent(longest)) == MAX_AGENT_ID_LENGTH
    with pytest.raises(ValueError) as too_long:
        acme.agent(longest + "a")
    assert "acme" not in str(too_long.value) and str(acme.max_agent_id) in str(too_long.value)
    with pytest.raises(ValueError):
        acme.agent("-starts-badly")  # the client's id obeys the same rule as without tenants


def test_a_request_for_a_tenant_has_its_ids_qualified_and_its_namespace_forced() -> None:
    request = GenerationRequest.model_validate(
        {
            "agent_id": "b",
            "fork_from": "a",
            "namespace": "wider",
            "messages": [{"role": "user", "content": "x"}],
        }
    )
    mine = Tenant("acme").request(request)
    assert (mine.agent_id, mine.fork_from, mine.namespace) == ("t:acme:b", "t:acme:a", "acme")
    one_off = Tenant("acme").request(GenerationRequest(prompt="x"))
    assert one_off.agent_id is None and one_off.namespace == "acme"


def test_a_bare_keys_tenant_is_a_digest_never_the_key() -> None:
    tenant = key_tenant("sk-secret-1")
    assert "secret" not in tenant and len(tenant) == 64 and tenant_problem(tenant) is None
    assert key_tenant("sk-secret-2") != tenant
    assert tenant_of(None) is None and tenant_of("acme") == Tenant("acme")


def test_a_key_file_names_tenants_beside_keys_and_stays_compatible(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# operator's keys\nsk-old acme\n\nsk-new   acme\nsk-bare\n")
    env = {"KVRQ_API_KEYS": "sk-env"}
    assert load_key_tenants(str(keys), env=env) == {
        "sk-env": None,
        "sk-old": "acme",
        "sk-new": "acme",
        "sk-bare": None,
    }
    assert load_keys(str(keys), env=env) == ["sk-env", "sk-old", "sk-new", "sk-bare"]
    for bad, says in (
        ("sk-a acme extra\n", ":1: a line is KEY"),
        ("sk-a bad:name\n", "tenant"),
        ("k\nk\n", ":2:"),
    ):
        keys.write_text(bad)
        with pytest.raises(ValueError) as caught:
            load_key_tenants(str(keys), env={})
        assert says in str(caught.value) and "sk-a" not in str(caught.value)


def test_producer_with_a_tenant_enqueues_its_qualified_job_and_reads_back_its_own_ids() -> None:
    producer = Producer(connection=fake_redis(), tenant="acme")
    handle = producer.submit({"agent_id": "a1", "prompt": "hi"})
    (payload,) = Job.fetch(handle.id, connection=producer.connection, serializer="json").args
    assert payload["agent_id"] == "t:acme:a1" and payload["namespace"] == "acme"
    result = result_payload(handle.id, agent_id="t:acme:a1", text="x")
    finisher = threading.Timer(0.1, _finish_like_a_worker, args=(producer, handle.id, result))
    finisher.start()
    assert handle.result(timeout=5).agent_id == "a1"
    finisher.join()


def test_a_tenants_failures_and_stream_errors_name_its_agents_as_its_client_does() -> None:
    producer = Producer(connection=fake_redis(), tenant="acme")
    handle = producer.submit(
        {"agent_id": "b", "fork_from": "a", "messages": [{"role": "user", "content": "x"}]}
    )
    reason = "fork_from agent 't:acme:a' has no conversation"
    producer.connection.xadd(stream_key(handle.id), StreamEvent("error", error=reason).to_fields())  # type: ignore[arg-type]
    fail_like_rq(
        producer.connection, handle.id, f"E: {reason}", {"code": ErrorCode.INVALID_REQUEST, "message": reason}
    )
    with pytest.raises(JobFailedError) as failed:
        handle.result(timeout=1)
    assert failed.value.reason == "fork_from agent 'a' has no conversation"
    assert "t:acme" not in failed.value.details
    errors = [event.error for event in handle.events(timeout=2) if event.kind == "error"]
    assert errors == ["fork_from agent 'a' has no conversation"]


def test_without_a_tenant_nothing_changes() -> None:
    producer = Producer(connection=fake_redis())
    handle = producer.submit({"agent_id": "a1", "prompt": "hi"})
    (payload,) = Job.fetch(handle.id, connection=producer.connection, serializer="json").args
    assert payload["agent_id"] == "a1" and "namespace" not in payload
    assert derive_run_id(b"lines", "kvrq") == derive_run_id(b"lines", "kvrq", None)


def test_batch_runs_of_two_tenants_are_two_runs_and_a_too_long_agent_is_an_error_line() -> None:
    assert derive_run_id(b"lines", "kvrq", "acme") != derive_run_id(b"lines", "kvrq", "other")
    assert derive_run_id(b"lines", "kvrq", "acme") != derive_run_id(b"lines", "kvrq")
    acme = Tenant("acme")
    fits = BatchRequest(1, "c1", "/v1/completions", "m", "a" * acme.max_agent_id, {"prompt": "x"})
    long = BatchRequest(2, "c2", "/v1/completions", "m", "a" * (acme.max_agent_id + 1), {"prompt": "x"})
    kept, refused = tenant_lines([fits, long], acme)
    assert kept is fits
    assert isinstance(refused, BadLine) and refused.custom_id == "c2" and refused.code == "invalid_request"


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        pools, "served_pools", lambda connection: {"smollm2-135m": Pool("smollm2-135m", "kvrq", 1)}
    )


def _enqueued(connection: Redis) -> list[dict[str, Any]]:
    """The payloads of every job in Redis."""
    ids = [key.decode()[len("rq:job:") :] for key in connection.scan_iter(match="rq:job:*")]
    jobs = [
        Job.fetch(job_id, connection=connection, serializer="json") for job_id in ids if ":" not in job_id
    ]
    return [job.args[0] for job in jobs if job.args]


@pytest.mark.usefixtures("served")
def test_kvrq_serve_qualifies_every_routes_job_for_the_keys_tenant() -> None:
    redis = fake_redis()
    settings = ServeSettings(
        api_keys=("sk-a", "sk-b"), key_tenants=(("sk-a", "acme"),), request_timeout_s=0.2
    )
    body = {**CHAT, "prompt_cache_key": "shared", "kvrq": {"fork_from": "src", "namespace": "wide"}}
    with TestClient(create_app(settings, **app_connections(redis))) as http:
        for key in ("sk-a", "sk-b"):
            answer = http.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"})
            assert answer.status_code == 504  # no worker: the job was enqueued, then timed out
        messages = {**CHAT, "metadata": {"user_id": "shared"}}
        http.post("/v1/messages", json=messages, headers={"x-api-key": "sk-a"})
        http.post(
            "/v1/chat/completions",
            json={**CHAT, "prompt_cache_key": "x" * 200},
            headers={"x-api-key": "sk-a"},
        )
    payloads = _enqueued(redis)
    bare = key_tenant("sk-b")
    seen = sorted(str((p.get("agent_id"), p.get("fork_from"), p.get("namespace"))) for p in payloads)
    expected = [
        ("t:acme:shared", "t:acme:src", "acme"),
        (f"t:{bare}:shared", f"t:{bare}:src", bare),
        ("t:acme:shared", None, "acme"),
    ]
    assert seen == sorted(str(row) for row in expected)


@pytest.mark.usefixtures("served")
def test_an_agent_id_too_long_for_its_tenant_is_400_without_the_tenant() -> None:
    settings = ServeSettings(api_keys=("sk-a",), key_tenants=(("sk-a", "acme"),))
    with TestClient(create_app(settings, **app_connections())) as http:
        answer = http.post(
            "/v1/chat/completions",
            json={**CHAT, "prompt_cache_key": "x" * 199},
            headers={"x-api-key": "sk-a"},
        )
    assert answer.status_code == 400 and "acme" not in answer.text and "agent id" in answer.text


def test_cache_and_agent_views_show_one_tenants_agents_by_their_client_ids(tmp_path: Path) -> None:
    from worker.cli.agent import run_agent_command
    from worker.cli.cache import list_agents, per_agent

    class Store:
        def __init__(self) -> None:
            self.agents = {"t:acme:a1": 10, "t:other:a1": 20, "plain": 30}

        def list(self) -> list[str]:
            return list(self.agents)

        def info(self, agent: str) -> object:
            if agent not in self.agents:
                return None
            return argparse.Namespace(
                agent_id=agent,
                namespace="default/acme",
                n_tokens=self.agents[agent],
                nbytes=1,
                last_used=0.0,
                shared_blocks=0,
                n_blocks=1,
                pinned=False,
                quantization="none",
            )

        def delete(self, agent: str) -> bool:
            return self.agents.pop(agent, None) is not None

        pin = unpin = delete

    store = Store()
    out = io.StringIO()
    list_agents(store, out, tenant=Tenant("acme"))  # type: ignore[arg-type]
    assert "1 agent(s)" in out.getvalue() and "a1 " in out.getvalue() and "t:" not in out.getvalue()
    out, err = io.StringIO(), io.StringIO()
    assert per_agent(store, "show", ["a1"], out, err, tenant=Tenant("acme")) == 0  # type: ignore[arg-type]
    assert out.getvalue().startswith("agent a1\n") and "  tokens: 10" in out.getvalue()
    assert per_agent(store, "delete", ["a1"], out, err, tenant=Tenant("acme")) == 0  # type: ignore[arg-type]
    assert set(store.agents) == {"t:other:a1", "plain"}  # the other tenant's a1 stays
    err = io.StringIO()
    bad = argparse.Namespace(
        action="show", agent_id="a1", tenant="bad:name", redis="redis://x", store=None, json=False
    )
    assert run_agent_command(bad, io.StringIO(), err) == 2 and "tenant" in err.getvalue()
