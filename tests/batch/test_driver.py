"""run_batch with fake completion sources: ordering, backpressure, resume, cancel (fakeredis, no worker)."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from producer import liveness
from producer.batch import batch_status, cancel_batch, run_batch
from producer.batch.jobs import JobOutcome, RqJobSource
from producer.batch.run import BatchRun, derive_run_id
from producer.wire.protocol import ErrorCode
from tests.batch.fakes import FakeJobs, RqFakeWorkerSource, read_output
from tests.producer.fakes import fail_like_rq, fake_redis


def line(custom_id: str, agent: str | None = None, text: str = "hello", **body: Any) -> str:
    record: dict[str, Any] = {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": text}], "max_tokens": 4, "temperature": 0, **body},
    }
    if agent is not None:
        record["kvrq"] = {"agent_id": agent}
    return json.dumps(record)


def agents_file(path: Path, agents: int = 3, turns: int = 4, bad: bool = True) -> Path:
    rows = [line(f"{a}-t{t}", agent=f"agent{a}") for t in range(turns) for a in range(agents)]
    rows.insert(2, line("solo-1"))
    if bad:
        rows.insert(5, "{oops")
        rows.insert(7, line("bad-url").replace("/v1/chat/completions", "/v1/embeddings"))
        rows.append(line("solo-1"))  # duplicate custom_id
    path.write_text("\n".join(rows) + "\n")
    return path


def custom_ids(records: list[dict[str, Any]]) -> Counter[str | None]:
    return Counter(r["custom_id"] for r in records)


def run(tmp_path: Path, jobs: Any, connection: Any, **kwargs: Any) -> Any:
    kwargs.setdefault("progress", False)
    kwargs.setdefault("concurrency", 4)
    return run_batch(
        tmp_path / "in.jsonl", tmp_path / "out.jsonl", connection=connection, jobs=jobs, **kwargs
    )


def test_every_line_once_agent_order_and_backpressure(tmp_path: Path) -> None:
    agents_file(tmp_path / "in.jsonl")
    jobs = FakeJobs(limit=4)
    connection = fake_redis()
    summary = run(tmp_path, jobs, connection)
    records = read_output(tmp_path / "out.jsonl")
    assert summary.state == "done" and summary.total == 16
    assert len(records) == 16 and summary.done == 13 and summary.failed == 3 and summary.invalid == 3
    counts = custom_ids(records)
    assert counts[None] == 2  # invalid JSON + the duplicate: no custom_id to report
    assert all(n == 1 for cid, n in counts.items() if cid is not None)
    assert jobs.violations == [] and jobs.max_unfinished == 4
    for a in range(3):  # each agent's turns ended in file order, with growing cache reuse
        mine = [r for r in records if r["kvrq"].get("agent_id") == f"agent{a}"]
        assert [r["custom_id"] for r in mine] == [f"{a}-t{t}" for t in range(4)]
        cached = [r["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] for r in mine]
        assert cached == [0, 10, 20, 30]
    errors = {r["kvrq"]["line"]: r["error"]["code"] for r in records if r["error"]}
    assert errors == {6: "invalid_json", 8: "unsupported_url", 16: "duplicate_custom_id"}
    info = BatchRun(connection, summary.run_id).info()
    assert info is not None and info.state == "done"
    assert info.counts["done"] == 13 and info.counts["failed"] == 3 and info.counts["queued"] == 0
    assert sorted(jobs.retired) == sorted(jobs.submitted)


def test_rerun_after_a_crash_resumes_without_duplicates(tmp_path: Path) -> None:
    agents_file(tmp_path / "in.jsonl", agents=4, turns=5)
    connection = fake_redis()
    waits = {"n": 0}

    def crash_on_fourth_wait(source: FakeJobs) -> None:
        waits["n"] += 1
        if waits["n"] == 4:
            source.run_some(2)  # these end while the client is down: picked up by the rerun
            raise KeyboardInterrupt

    jobs = FakeJobs(limit=6, on_wait=crash_on_fourth_wait)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, jobs, connection, concurrency=6)
    first = read_output(tmp_path / "out.jsonl")
    assert 0 < len(first) < 24
    submitted_before = len(jobs.submitted)
    jobs.on_wait = None
    summary = run(tmp_path, jobs, connection, concurrency=6)
    records = read_output(tmp_path / "out.jsonl")
    assert len(records) == 24 and summary.done + summary.failed == 24
    assert all(n == 1 for cid, n in custom_ids(records).items() if cid is not None)
    assert jobs.violations == []  # no id enqueued twice, agent order kept across the crash
    assert summary.skipped == len(first)
    assert summary.reattached > 0 and summary.submitted + submitted_before == len(jobs.submitted) == 21


def test_failed_jobs_become_error_lines_and_the_run_goes_on(tmp_path: Path) -> None:
    rows = [line("ok-1"), line("huge", text="x" * 50), line("ok-2")]
    (tmp_path / "in.jsonl").write_text("\n".join(rows))
    too_long = "prompt (9000 tokens) + max_tokens (4) exceeds the model context of 8192 tokens"
    failure = (ErrorCode.CONTEXT_LENGTH_EXCEEDED, too_long)
    jobs = FakeJobs(fail_when=lambda req: failure if "xxxx" in req["messages"][0]["content"] else None)
    summary = run(tmp_path, jobs, fake_redis())
    records = {r["custom_id"]: r for r in read_output(tmp_path / "out.jsonl")}
    assert summary.done == 2 and summary.failed == 1
    assert records["huge"]["error"] == {"code": "context_length_exceeded", "message": too_long}
    assert records["huge"]["response"] is None


def test_empty_input_is_a_clean_no_op(tmp_path: Path) -> None:
    (tmp_path / "in.jsonl").write_text("\n  \n")
    summary = run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", progress=False)  # no Redis needed
    assert summary.total == 0 and summary.state == "done" and summary.submitted == 0
    assert (tmp_path / "out.jsonl").read_text() == ""


def test_a_vanished_job_is_enqueued_again_then_given_up(tmp_path: Path) -> None:
    (tmp_path / "in.jsonl").write_text(line("a") + "\n" + line("b"))

    def flush_a(source: FakeJobs) -> None:
        source.jobs.pop(next(j for j in source.jobs if j.endswith("_c_a")), None)

    jobs = FakeJobs(per_wait=0, on_wait=flush_a)
    jobs.per_wait = 0
    original_wait = jobs.wait

    def wait_and_finish_b(job_ids: Any, timeout_s: float) -> None:
        original_wait(job_ids, timeout_s)
        for job_id, job in jobs.jobs.items():
            if job_id.endswith("_c_b") and job.state == "queued":
                job.state, job.result = "finished", {"text": "b", "usage": {}}

    jobs.wait = wait_and_finish_b  # type: ignore[method-assign]
    summary = run(tmp_path, jobs, fake_redis())
    records = {r["custom_id"]: r for r in read_output(tmp_path / "out.jsonl")}
    assert records["a"]["error"]["code"] == "job_lost" and records["b"]["error"] is None
    assert summary.failed == 1


def test_cancel_stops_the_client_and_a_rerun_finishes_the_run(tmp_path: Path) -> None:
    agents_file(tmp_path / "in.jsonl", bad=False)
    connection = fake_redis()
    run_id = derive_run_id((tmp_path / "in.jsonl").read_bytes(), "kvrq")

    def cancel_on_second_wait(source: FakeJobs) -> None:
        if len(source.finished_order) >= 3:
            BatchRun(connection, run_id).mark_canceled()
            source.cancel(source.unfinished())

    jobs = FakeJobs(per_wait=3, on_wait=cancel_on_second_wait)
    summary = run(tmp_path, jobs, connection)
    assert summary.state == "canceled"
    assert 0 < len(read_output(tmp_path / "out.jsonl")) < 13
    assert BatchRun(connection, run_id).state() == "canceled"
    jobs.on_wait = None
    again = run(tmp_path, jobs, connection)
    records = read_output(tmp_path / "out.jsonl")
    assert again.state == "done" and len(records) == 13 and all(r["error"] is None for r in records)
    assert all(n == 1 for n in custom_ids(records).values())


def test_rq_backed_source_end_to_end_with_status_and_cancel(tmp_path: Path) -> None:
    """The real RqJobSource (Producer.submit_many, rq statuses and Result streams) on fakeredis."""
    rows = [line(f"r{i}", agent=f"a{i % 2}") for i in range(6)] + ["not json"]
    (tmp_path / "in.jsonl").write_text("\n".join(rows))
    connection = fake_redis()
    source = RqFakeWorkerSource(connection, "kvrq", per_wait=2)
    summary = run(tmp_path, source, connection, concurrency=3, poll_interval_s=0.01)
    records = read_output(tmp_path / "out.jsonl")
    assert summary.done == 6 and summary.failed == 1 and len(records) == 7
    assert [r["custom_id"] for r in records if r["kvrq"].get("agent_id") == "a0"] == ["r0", "r2", "r4"]
    assert records[1]["response"]["body"]["choices"][0]["message"]["content"] == "answer to r0"
    status = batch_status(connection, summary.run_id)
    assert status["state"] == "done" and status["done"] == 6 and status["jobs_by_state"] == {"finished": 6}
    assert 0 < connection.ttl(f"rq:job:{records[1]['kvrq']['job_id']}") <= 600  # retired after writing

    # cancel: queued jobs of a run that no client drives any more
    (tmp_path / "in2.jsonl").write_text("\n".join(line(f"s{i}") for i in range(3)))
    idle = RqFakeWorkerSource(connection, "kvrq", per_wait=0)

    def stop_after_submitting(job_ids: Any, timeout_s: float) -> None:
        raise KeyboardInterrupt

    idle.wait = stop_after_submitting  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        run_batch(
            tmp_path / "in2.jsonl", tmp_path / "out2.jsonl", connection=connection, jobs=idle, progress=False
        )
    run_id = derive_run_id((tmp_path / "in2.jsonl").read_bytes(), "kvrq")
    assert batch_status(connection, run_id)["jobs_by_state"] == {"queued": 3}
    assert cancel_batch(connection, run_id) == 3
    status = batch_status(connection, run_id)
    assert status["state"] == "canceled" and status["jobs_by_state"] == {"canceled": 3}
    # resuming the canceled run enqueues the lines afresh (the cancel flags must not cancel them again)
    resumed = run_batch(
        tmp_path / "in2.jsonl",
        tmp_path / "out2.jsonl",
        connection=connection,
        jobs=RqFakeWorkerSource(connection, "kvrq", per_wait=3),
        progress=False,
        poll_interval_s=0.01,
    )
    assert resumed.state == "done" and resumed.done == 3 and resumed.submitted == 3
    assert not [k for k in connection.scan_iter("kvrq:cancel:*")]


def test_rq_source_reads_each_failed_jobs_code_not_its_text() -> None:
    connection = fake_redis()
    source = RqJobSource(connection, "kvrq")
    source.submit([("j-big", {"prompt": "a"}), ("j-crash", {"prompt": "b"}), ("j-odd", {"prompt": "c"})])
    too_big = {"code": ErrorCode.CONTEXT_LENGTH_EXCEEDED, "message": "prompt + max_tokens exceed 8192 tokens"}
    fail_like_rq(connection, "j-big", "Traceback ...\nRuntimeError: says nothing about context", too_big)
    fail_like_rq(connection, "j-crash", "Moved to FailedJobRegistry, due to AbandonedJobError, at now")
    fail_like_rq(connection, "j-odd", "Traceback ...\nInvalidRequestError: text that is not a code")
    outcomes = source.lookup(["j-big", "j-crash", "j-odd"])
    assert outcomes["j-big"] == JobOutcome("failed", error=too_big["message"], code=too_big["code"])
    assert outcomes["j-crash"].code == ErrorCode.WORKER_CRASHED
    assert outcomes["j-odd"].code == ErrorCode.INTERNAL  # no kvrq meta: the exception's name decides nothing


def test_a_stalled_run_says_once_that_no_worker_listens_and_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(liveness, "FIRST_NOTICE_S", 0.05)
    agents_file(tmp_path / "in.jsonl", bad=False)
    stalls = [0.06, 0.06, 0.06]  # three polls with nothing ending, longer than the notice delay each

    def stall_then_run(source: FakeJobs) -> None:
        source.per_wait = 0 if stalls else 5
        if stalls:
            time.sleep(stalls.pop())

    said: list[str] = []
    summary = run(tmp_path, FakeJobs(on_wait=stall_then_run), fake_redis(), log=said.append)
    assert summary.state == "done" and summary.done == 13
    notices = [text for text in said if "no live worker listens on queue 'kvrq'" in text]
    assert notices == [f"batch {summary.run_id}: {liveness.no_worker_line('kvrq')}"]
