"""`kvrq serve`'s app without a worker (fakeredis): the checks before a job is enqueued and their statuses."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from redis import Redis

from producer.http import pools
from producer.http.app import ServeSettings, create_app
from producer.http.errors import APIError
from producer.http.guard import load_keys
from producer.http.pools import Pool, PoolDirectory
from producer.wire.protocol import CAPACITY_FIELD, MODEL_FIELD, worker_alive_key
from tests.producer.fakes import app_connections, fake_redis
from worker.jobs.rqexec import KvrqWorker

CHAT = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
MESSAGES = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def client(**settings: object) -> TestClient:
    return TestClient(create_app(ServeSettings(**settings), **app_connections()))  # type: ignore[arg-type]


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Pool]]:
    """The pools the app sees: edit the dict to start and stop workers."""
    live: dict[str, Pool] = {"smollm2-135m": Pool("smollm2-135m", "kvrq", 1)}
    monkeypatch.setattr(pools, "served_pools", lambda connection: dict(live))
    yield live


def test_health_and_models_with_no_worker() -> None:
    with client() as http:
        assert http.get("/health").json() == {"status": "ok", "models": []}
        assert http.get("/v1/models").json() == {"object": "list", "data": []}


def test_models_lists_the_served_ones_in_each_apis_shape(served: dict[str, Pool]) -> None:
    with client() as http:
        (model,) = http.get("/v1/models").json()["data"]
        assert model["id"] == "smollm2-135m" and model["object"] == "model"
        anthropic = http.get("/v1/models", headers={"anthropic-version": "2023-06-01"}).json()
        assert anthropic["data"][0]["type"] == "model" and anthropic["first_id"] == "smollm2-135m"


def test_no_live_worker_is_503_with_retry_after() -> None:
    with client() as http:
        answer = http.post("/v1/chat/completions", json=CHAT)
        assert answer.status_code == 503 and answer.headers["retry-after"] == "5"
        assert answer.json()["error"]["code"] == "no_worker"
        answer = http.post("/v1/messages", json=MESSAGES)
        assert answer.status_code == 503 and answer.json()["error"]["type"] == "overloaded_error"


def test_unknown_model_is_404_naming_the_served_ones(served: dict[str, Pool]) -> None:
    with client() as http:
        answer = http.post("/v1/chat/completions", json={**CHAT, "model": "gpt-4o"})
        assert answer.status_code == 404
        assert answer.json()["error"]["code"] == "model_not_found"
        assert "smollm2-135m" in answer.json()["error"]["message"]
        answer = http.post("/v1/messages", json={**MESSAGES, "model": "claude"})
        assert answer.status_code == 404 and answer.json()["error"]["type"] == "not_found_error"


def test_a_model_whose_workers_all_left_is_503(served: dict[str, Pool]) -> None:
    directory = PoolDirectory(fake_redis(), ttl_s=0.0)
    assert directory.resolve("smollm2-135m").queue == "kvrq"
    assert directory.resolve(None).model == "smollm2-135m"  # the only one served
    served.clear()
    served["other"] = Pool("other", "other-q", 1)
    with pytest.raises(Exception) as caught:
        directory.resolve("smollm2-135m")
    assert getattr(caught.value, "status", None) == 503


def test_invalid_bodies_are_400_in_each_apis_shape(served: dict[str, Pool]) -> None:
    with client() as http:
        answer = http.post(
            "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert answer.status_code == 400 and "not valid JSON" in answer.json()["error"]["message"]
        answer = http.post("/v1/messages", content=b"[" * 100_000 + b"]" * 100_000)
        assert answer.status_code == 400 and "nested too deeply" in answer.json()["error"]["message"]
        answer = http.post("/v1/chat/completions", json={**CHAT, "temperature": -1})
        assert answer.status_code == 400
        assert answer.json()["error"]["message"].startswith("temperature: Input should be greater than")
        answer = http.post("/v1/messages", json={**MESSAGES, "max_tokens": 0})
        assert answer.status_code == 400 and answer.json()["type"] == "error"
        assert answer.json()["error"]["type"] == "invalid_request_error"
        answer = http.post("/v1/chat/completions", json={**CHAT, "prompt_cache_key": "has space"})
        assert answer.status_code == 400 and "agent id" in answer.json()["error"]["message"]


def test_a_body_over_the_limit_is_413_before_it_is_read() -> None:
    with client(max_body_bytes=1000) as http:
        answer = http.post(
            "/v1/chat/completions", content=b"x" * 1001, headers={"content-type": "application/json"}
        )
        assert answer.status_code == 413 and answer.json()["error"]["code"] == "request_too_large"
        answer = http.post("/v1/messages", content=b"x" * 1001)
        assert answer.status_code == 413 and answer.json()["error"]["type"] == "request_too_large"

        def chunks() -> Iterator[bytes]:  # no Content-Length: cut off once past the limit
            yield from [b"x" * 600, b"x" * 600]

        answer = http.post("/v1/chat/completions", content=chunks())
        assert answer.status_code == 413


def test_api_keys_are_required_when_set(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# ours\nsecret-1\n\nsecret-2\n")
    assert load_keys(str(keys), env={"KVRQ_API_KEYS": "a, b"}) == ["a", "b", "secret-1", "secret-2"]
    with client(api_keys=("secret-1", "secret-2")) as http:
        assert http.get("/health").status_code == 200  # open for health checks
        answer = http.get("/v1/models")
        assert answer.status_code == 401 and answer.json()["error"]["type"] == "authentication_error"
        assert http.get("/v1/models", headers={"authorization": "Bearer wrong"}).status_code == 401
        assert http.get("/v1/models", headers={"authorization": "Bearer secret-2"}).status_code == 200
        assert http.get("/v1/models", headers={"x-api-key": "secret-1"}).status_code == 200
        answer = http.post("/v1/messages", json=MESSAGES)
        assert answer.status_code == 401 and answer.json()["error"]["type"] == "authentication_error"


def test_unknown_routes_answer_in_the_apis_shape() -> None:
    with client() as http:
        answer = http.get("/v1/chat/completions")
        assert answer.status_code == 405 and "error" in answer.json()
        assert http.post("/v1/embeddings", json={}).json()["error"]["type"] == "invalid_request_error"


def _registered_worker(connection: Redis, name: str) -> KvrqWorker:
    """A kvrq worker as `kvrq serve` sees one: registered with rq, its model and capacity written,
    its liveness key set."""
    worker = KvrqWorker(["kvrq"], connection=connection, name=name)
    worker.register_birth()
    connection.hset(worker.key, mapping={MODEL_FIELD: "smollm2-135m", CAPACITY_FIELD: 4})
    connection.set(worker_alive_key(name), 1)
    return worker


def test_a_model_whose_workers_lapsed_but_stay_registered_is_served_for_the_grace() -> None:
    """A failover's write pause outlasts the workers' liveness keys but not their rq registration:
    requests wait for them (no 503) for LAPSED_GRACE_S after the model was last seen live; workers
    that left (unregistered) get the 503 at once."""
    connection = fake_redis()
    worker = _registered_worker(connection, "w1")
    directory = PoolDirectory(connection, ttl_s=0.0)
    assert directory.resolve("smollm2-135m").queue == "kvrq"
    connection.delete(worker_alive_key("w1"))  # lapsed in the pause; still registered
    assert directory.resolve("smollm2-135m").queue == "kvrq"
    assert directory.resolve(None).model == "smollm2-135m"
    pool, seen = directory._live_at["smollm2-135m"]
    directory._live_at["smollm2-135m"] = (pool, seen - pools.LAPSED_GRACE_S - 1)
    with pytest.raises(APIError) as caught:
        directory.resolve("smollm2-135m")
    assert caught.value.status == 503
    directory._live_at["smollm2-135m"] = (pool, seen)
    worker.register_death()  # left: unregistered
    with pytest.raises(APIError) as caught:
        directory.resolve("smollm2-135m")
    assert caught.value.status == 503
