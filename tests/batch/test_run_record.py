"""The run object in Redis (fakeredis): ids, state, counts, cancel."""

from __future__ import annotations

import pytest
from rq.job import JOB_ID_PATTERN

from producer.batch.run import BatchRun, derive_run_id, job_id_for, list_runs, validate_run_id
from producer.wire.protocol import batch_jobs_key, batch_run_key
from tests.producer.fakes import fake_redis


def test_run_id_follows_the_input_and_the_queue() -> None:
    assert derive_run_id(b"x\n", "kvrq") == derive_run_id(b"x\n", "kvrq")
    assert derive_run_id(b"x\n", "kvrq") != derive_run_id(b"y\n", "kvrq")
    assert derive_run_id(b"x\n", "kvrq") != derive_run_id(b"x\n", "other")
    with pytest.raises(ValueError):
        validate_run_id("has space")


@pytest.mark.parametrize("custom_id", ["request-1", "a.b/c d", "é" * 3, "x" * 200])
def test_job_ids_are_deterministic_valid_rq_ids(custom_id: str) -> None:
    job_id = job_id_for("batch-0123", custom_id)
    assert job_id == job_id_for("batch-0123", custom_id)
    assert JOB_ID_PATTERN.fullmatch(job_id)
    assert job_id != job_id_for("batch-0123", custom_id + "!")


def test_record_counts_state_and_listing() -> None:
    connection = fake_redis()
    run = BatchRun(connection, "run-1")
    assert run.start(queue="q", total=5, input_path="in", output_path="out", concurrency=4) is None
    run.add_jobs(["j1", "j2"])
    run.update(state="running", queued=1, running=1, done=2, failed=1, invalid=1)
    info = run.info()
    assert info is not None and info.state == "running" and info.queue == "q"
    assert info.counts == {"total": 5, "queued": 1, "running": 1, "done": 2, "failed": 1, "invalid": 1}
    assert info.fields["jobs"] == "2" and run.job_ids() == {"j1", "j2"}
    assert [i.run_id for i in list_runs(connection)] == ["run-1"]
    run.update(state="done")
    assert connection.ttl(run.key) > 0  # finished runs expire
    assert run.start(queue="q", total=5, input_path="in", output_path="out", concurrency=4) == "done"
    assert connection.ttl(run.key) == -1  # a rerun keeps it again


def test_a_canceled_run_is_not_revived_by_a_late_counts_update() -> None:
    run = BatchRun(fake_redis(), "run-2")
    run.start(queue="q", total=1, input_path="in", output_path="out", concurrency=1)
    run.mark_canceled()
    assert run.update(state="submitting", done=0) == "canceled"
    assert run.state() == "canceled"
    run.update(state="done")
    assert run.state() == "done"


def test_records_written_with_the_old_cancelled_spelling_read_as_canceled() -> None:
    connection = fake_redis()
    run = BatchRun(connection, "run-3")
    run.start(queue="q", total=1, input_path="in", output_path="out", concurrency=1)
    connection.hset(run.key, "state", "cancelled")  # what kvrq wrote before it used rq's spelling
    info = run.info()
    assert run.state() == "canceled" and info is not None and info.state == "canceled"
    assert run.update(state="running") == "canceled" and run.state() == "canceled"  # still not revived
    assert run.start(queue="q", total=1, input_path="in", output_path="out", concurrency=1) == "canceled"


def test_run_keys_follow_the_protocol() -> None:
    run = BatchRun(fake_redis(), "run-4")
    assert (run.key, run.jobs_key) == (batch_run_key("run-4"), batch_jobs_key("run-4"))
    assert run.key == "kvrq:batch:run:run-4" and run.jobs_key == "kvrq:batch:run:run-4:jobs"
