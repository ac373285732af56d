"""docs/async.md's FastAPI example, run as written (its Redis URL pointed at the test's), against the
stand-in worker (benchmarks/procs.py): it streams the job's answer."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from benchmarks.procs import StandInWorker

pytestmark = pytest.mark.integration

DOC = Path(__file__).resolve().parents[2] / "docs" / "async.md"


def test_the_fastapi_example_streams_the_answer(redis_url: str) -> None:
    blocks = re.findall(r"^```python\n(.*?)^```", DOC.read_text(), re.M | re.S)
    example = next(block for block in blocks if "FastAPI(" in block)
    namespace: dict[str, Any] = {}
    exec(compile(example.replace("redis://127.0.0.1:6379/0", redis_url), str(DOC), "exec"), namespace)
    worker = StandInWorker(redis_url)
    worker.start()
    try:
        with TestClient(namespace["app"]) as http:
            answer = http.post("/ask/alice", params={"question": "hello there"})
        assert answer.status_code == 200 and answer.text == "hello there"
    finally:
        worker.close()
