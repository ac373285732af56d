"""Batch runs against a real redis-server and real `kvrq worker` processes on the builtin model.

Small on purpose (max_tokens 4, short prompts): the CI machine has two cores.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis import Redis

from producer.batch import batch_status, run_batch
from tests.batch.fakes import read_output
from tests.conftest import RedisServer
from tests.worker.procs import ROOT, WorkerProcess, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MAX_TOKENS = 4


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, WorkerProcess]]:
    """One redis-server and one worker for the module; tests use their own agent ids and inputs."""
    workdir = tmp_path_factory.mktemp("batch-stack")
    server = RedisServer(workdir)
    server.start()
    worker = WorkerProcess(server.url, workdir, name="batch-w1")
    try:
        worker.start()
        yield server.url, workdir, worker
    finally:
        worker.stop()
        server.stop()


def conversation_lines(prefix: str, agents: int, turns: int) -> list[dict[str, Any]]:
    """Agent a's turn t carries the whole chat so far: a system message, t earlier exchanges, a new question.

    Lines interleave agents (turn 0 of every agent, then turn 1, ...), as a simulation writes them.
    """
    rows = []
    for turn in range(turns):
        for agent in range(agents):
            messages = [
                {"role": "system", "content": f"You are agent {agent}. Answer in one short sentence."}
            ]
            for earlier in range(turn):
                messages.append({"role": "user", "content": f"Question {earlier}: name a color."})
                messages.append({"role": "assistant", "content": f"Color number {earlier} is blue."})
            messages.append({"role": "user", "content": f"Question {turn}: name a color."})
            rows.append(
                {
                    "custom_id": f"{prefix}-a{agent}-t{turn}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {
                        "model": "smollm2",
                        "messages": messages,
                        "max_tokens": MAX_TOKENS,
                        "temperature": 0,
                    },
                    "kvrq": {"agent_id": f"{prefix}-agent{agent}"},
                }
            )
    return rows


BAD_LINES = [
    "{this is not json",
    json.dumps({"custom_id": "bad-field", "url": "/v1/chat/completions", "body": {"messages": []}, "x": 1}),
    json.dumps({"custom_id": "bad-nobody", "method": "POST", "url": "/v1/chat/completions"}),
    json.dumps({"custom_id": "bad-url", "url": "/v1/embeddings", "body": {"input": "hi"}}),
]


def too_long_line() -> dict[str, Any]:
    return {
        "custom_id": "too-long",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"prompt": "word " * 9000, "max_tokens": MAX_TOKENS},
    }


def write_input(path: Path, rows: list[Any]) -> Path:
    path.write_text("\n".join(row if isinstance(row, str) else json.dumps(row) for row in rows) + "\n")
    return path


def check_complete(records: list[dict[str, Any]], expected_ids: set[str]) -> None:
    counts = Counter(r["custom_id"] for r in records if r["custom_id"] is not None)
    duplicates = {cid: n for cid, n in counts.items() if n > 1}
    assert not duplicates, duplicates
    assert set(counts) == expected_ids, set(counts) ^ expected_ids


def check_agent_turns(records: list[dict[str, Any]], prefix: str, agents: int, turns: int) -> None:
    """Turns of an agent ended in file order, and every later turn reused the agent's cache."""
    for agent in range(agents):
        mine = [r for r in records if r["kvrq"].get("agent_id") == f"{prefix}-agent{agent}"]
        assert [r["custom_id"] for r in mine] == [f"{prefix}-a{agent}-t{t}" for t in range(turns)]
        assert all(r["error"] is None for r in mine), [r["error"] for r in mine if r["error"]]
        usage = [r["response"]["body"]["usage"] for r in mine]
        assert usage[0]["prompt_tokens_details"]["cached_tokens"] == 0
        for later in usage[1:]:
            assert later["prompt_tokens_details"]["cached_tokens"] > 0, usage
        assert all(u["completion_tokens"] <= MAX_TOKENS for u in usage)


def test_fifty_lines_five_agents_ten_turns_and_bad_lines(
    stack: tuple[str, Path, WorkerProcess], tmp_path: Path
) -> None:
    redis_url, _, _ = stack
    rows: list[Any] = conversation_lines("s1", agents=5, turns=10)
    for offset, bad in enumerate(BAD_LINES):
        rows.insert(7 + 9 * offset, bad)
    rows.insert(30, too_long_line())
    rows.append(rows[0])  # duplicate custom_id
    source = write_input(tmp_path / "in.jsonl", rows)
    summary = run_batch(
        source, tmp_path / "out.jsonl", redis_url=redis_url, progress=False, poll_interval_s=0.5
    )
    records = read_output(tmp_path / "out.jsonl")
    assert summary.state == "done" and summary.total == 56 and len(records) == 56
    assert summary.done == 50 and summary.failed == 6 and summary.invalid == 5
    check_complete(
        records,
        {f"s1-a{a}-t{t}" for a in range(5) for t in range(10)}
        | {"bad-field", "bad-nobody", "bad-url", "too-long"},
    )
    check_agent_turns(records, "s1", agents=5, turns=10)
    errors = {r["kvrq"]["line"]: r["error"] for r in records if r["error"]}
    codes = sorted(e["code"] for e in errors.values())
    assert codes == sorted(
        [
            "invalid_json",
            "invalid_request",
            "invalid_request",
            "unsupported_url",
            "context_length_exceeded",
            "duplicate_custom_id",
        ]
    )
    too_long = next(r for r in records if r["custom_id"] == "too-long")
    assert "context" in too_long["error"]["message"]
    status = batch_status(Redis.from_url(redis_url), summary.run_id)
    assert status["state"] == "done" and status["done"] == 50 and status["failed"] == 6


def test_killed_client_reruns_without_duplicates_or_gaps(
    stack: tuple[str, Path, WorkerProcess], tmp_path: Path
) -> None:
    redis_url, _, _ = stack
    rows = conversation_lines("s2", agents=4, turns=5)
    source = write_input(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    command = [
        sys.executable,
        "-m",
        "worker.cli",
        "batch",
        "run",
        str(source),
        "-o",
        str(out),
        "--redis",
        redis_url,
        "--concurrency",
        "4",
        "--progress",
        "log",
    ]
    client = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_for(
            lambda: out.exists() and len(out.read_text().splitlines()) >= 8,
            240,
            "no progress before the kill",
        )
        client.send_signal(signal.SIGKILL)
        client.wait(timeout=10)
    finally:
        if client.poll() is None:
            client.kill()
    before = read_output(out)
    assert 8 <= len(before) < 20
    rerun = subprocess.run([*command, "--json"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    summary = json.loads(rerun.stdout)
    records = read_output(out)
    assert len(records) == 20 and summary["skipped"] == len(before)
    assert summary["submitted"] + summary["reattached"] == 20 - len(before)
    assert summary["reattached"] >= 1  # the killed client's jobs were waited for, not enqueued again
    check_complete(records, {f"s2-a{a}-t{t}" for a in range(4) for t in range(5)})
    check_agent_turns(records, "s2", agents=4, turns=5)
    jobs = [r["kvrq"]["job_id"] for r in records]
    assert len(set(jobs)) == 20


def test_two_workers_drain_one_run(stack: tuple[str, Path, WorkerProcess], tmp_path: Path) -> None:
    redis_url, workdir, _ = stack
    second = WorkerProcess(
        redis_url, workdir, name="batch-w2"
    )  # same disk store: agents move between workers
    try:
        second.start()
        rows = conversation_lines("s3", agents=6, turns=3) + [
            {
                "custom_id": f"s3-solo{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"prompt": f"Fact {i}:", "max_tokens": MAX_TOKENS, "temperature": 0},
            }
            for i in range(12)
        ]
        source = write_input(tmp_path / "in.jsonl", rows)
        started = time.monotonic()
        summary = run_batch(source, tmp_path / "out.jsonl", redis_url=redis_url, progress=False)
        records = read_output(tmp_path / "out.jsonl")
        assert summary.state == "done" and summary.done == 30, time.monotonic() - started
        check_complete(records, {r["custom_id"] for r in rows})
        check_agent_turns(records, "s3", agents=6, turns=3)
        workers = Counter(r["kvrq"]["worker"] for r in records)
        assert set(workers) == {"batch-w1", "batch-w2"}, workers
    finally:
        second.stop()
