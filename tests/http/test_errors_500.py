"""A 500 that does happen, over a real uvicorn socket: the app of `kvrq serve` with one test-only route
that raises. The client gets a request id the log also holds, the response says `Connection: close`,
and a keep-alive client's next request on the same client succeeds."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import httpx
import pytest
import uvicorn

from producer.http.app import ServeSettings, create_app
from tests.conftest import free_port
from tests.producer.fakes import app_connections
from tests.worker.procs import wait_for


class Broken(Exception):
    """What the test-only route raises."""


@pytest.fixture
def server() -> Iterator[str]:
    app = create_app(ServeSettings(), **app_connections())

    @app.get("/v1/broken")
    async def broken() -> None:
        raise Broken("a bug")

    @app.post("/v1/messages/broken")
    async def broken_anthropic() -> None:
        raise Broken("a bug")

    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    served = uvicorn.Server(config)
    thread = threading.Thread(target=served.run, daemon=True)
    thread.start()
    wait_for(lambda: served.started, 10, "uvicorn did not start")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        served.should_exit = True
        thread.join(timeout=10)


def test_a_500_has_a_request_id_in_the_log_and_closes_the_connection(
    server: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="kvrq.http")
    with httpx.Client(base_url=server, timeout=10) as client:  # keep-alive: one pooled connection
        assert client.get("/health").status_code == 200
        answer = client.get("/v1/broken")
        assert answer.status_code == 500
        assert answer.headers["connection"] == "close"
        request_id = answer.headers["x-request-id"]
        assert request_id.startswith("req_") and answer.headers["request-id"] == request_id
        error = answer.json()["error"]
        assert error["type"] == "server_error" and request_id in error["message"]
        assert "Broken" in error["message"] and "a bug" not in error["message"]  # no internals
        (record,) = [r for r in caplog.records if request_id in r.getMessage()]
        assert record.exc_info is not None and record.exc_info[0] is Broken
        assert client.get("/health").status_code == 200  # the next request on this client works
        answer = client.post("/v1/messages/broken", json={})
        assert answer.status_code == 500 and answer.json()["error"]["type"] == "api_error"
        assert answer.headers["request-id"] in answer.json()["error"]["message"]
        assert client.get("/health").status_code == 200
