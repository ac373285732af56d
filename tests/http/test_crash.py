"""A worker killed (`kill -9`) in the middle of an HTTP stream: the job runs again on another worker and
the client's stream goes on where it was, nothing repeated and nothing lost (greedy: the re-run says
the same), ending as one whole answer equal to the job's result."""

from __future__ import annotations

import threading
from pathlib import Path

import openai
import pytest
from redis import Redis

from producer.client import JobHandle
from tests.http.test_integration import MODEL, ServeProcess
from tests.worker.procs import RedisProcess, WorkerProcess, wait_for
from tests.worker.test_integration_crash import FAST_LIVENESS, STORY, generating

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_stream_survives_its_workers_death(tmp_path: Path) -> None:
    redis = RedisProcess(tmp_path)
    redis.start()
    first = WorkerProcess(redis.url, tmp_path, name="http-crash-1", env=FAST_LIVENESS)
    second = WorkerProcess(redis.url, tmp_path, name="http-crash-2", env=FAST_LIVENESS)
    server = ServeProcess(redis.url, tmp_path)
    try:
        first.start()
        wait_for(lambda: server.serves(MODEL), 60, "kvrq serve did not list the model")
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=180)
        stream = client.completions.create(
            model=MODEL, prompt=STORY, max_tokens=40, temperature=0, stream=True
        )
        chunks = iter(stream)
        head = next(chunks)
        job_id = head.id.removeprefix("cmpl-")
        connection = Redis.from_url(redis.url)
        texts = [head.choices[0].text]
        rest: list[str] = []
        reader = threading.Thread(target=lambda: rest.extend(c.choices[0].text for c in chunks if c.choices))
        reader.start()
        wait_for(lambda: generating(connection, job_id), 60, "no token yet")
        first.kill()  # mid-stream
        second.start()
        reader.join(timeout=180)
        assert not reader.is_alive(), "the stream never ended"
        result = JobHandle(connection, job_id).result(timeout=60)
        starts = [e for e in connection.xrange(f"kvrq:stream:{job_id}") if e[1].get(b"e") == b"start"]
        assert len(starts) == 2, "the job did not run again"
        assert "".join(texts + rest) == result.text and len(result.token_ids) == 40
    finally:
        server.stop()
        first.stop()
        second.stop()
        redis.stop()
