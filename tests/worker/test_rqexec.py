"""The rq internals worker/jobs/rqexec.py relies on, checked against the installed rq.

These fail loudly, naming what moved, when the pinned rq changes them: update rqexec.py (the
only module that touches them) and the pin in pyproject together.
"""

from __future__ import annotations

import inspect
import logging

import pytest
import rq
from redis.exceptions import ConnectionError as RedisConnectionError
from rq.callbacks import execute_failure_callback, execute_stopped_callback, execute_success_callback
from rq.executions import Execution
from rq.job_lifecycle import record_job_failure
from rq.registry import StartedJobRegistry
from rq.worker import BaseWorker
from rq.worker_registration import REDIS_WORKER_KEYS, WORKERS_BY_QUEUE_KEY

from tests.producer.fakes import fake_redis
from tests.worker.harness import Harness
from worker.jobs import rqexec


def test_rq_is_the_pinned_minor_version() -> None:
    assert rq.__version__.startswith("3.0."), f"rqexec.py was written against rq 3.0.x, not {rq.__version__}"


def test_private_and_execution_api_signatures() -> None:
    # finish_job does what _finalize_success does, with a success callback that cannot fail the job
    finalize = inspect.getsource(BaseWorker._finalize_success)
    for step in (
        "handle_execution_ended",
        "job._result = ",
        "job._status = JobStatus.FINISHED",
        "execute_success_callback(job, self.death_penalty_class, return_value)",
        "self.handle_job_success(",
        "job.send_webhooks(JobStatus.FINISHED)",
    ):
        assert step in finalize, f"rq's _finalize_success no longer does {step!r}: update rqexec.finish_job"
    success = inspect.signature(BaseWorker.handle_job_success)
    assert list(success.parameters) == ["self", "job", "queue", "started_job_registry", "execution"]
    # fail_job shows a failure callback the job as FAILED, as rq's _finalize_failure does
    finalize_failure = inspect.getsource(BaseWorker._finalize_failure)
    assert finalize_failure.index("job._status = JobStatus.FAILED") < finalize_failure.index(
        "execute_failure_callback("
    )
    # stop_job relies on rq's marker for "stopped on request": STOPPED, not retried
    assert "self._stopped_job_id == job.id" in inspect.getsource(BaseWorker.handle_job_failure)
    for runner, arguments in (
        (execute_success_callback, ["job", "death_penalty_class", "result"]),
        (execute_failure_callback, ["job", "death_penalty_class", "exc_info"]),
        (execute_stopped_callback, ["job", "death_penalty_class"]),
    ):
        assert list(inspect.signature(runner).parameters) == arguments
    prepare = inspect.signature(BaseWorker.prepare_job_execution)
    assert "remove_from_intermediate_queue" in prepare.parameters
    assert "execution" in inspect.signature(BaseWorker.cleanup_execution).parameters
    assert "exc_string" in inspect.signature(BaseWorker.handle_job_failure).parameters
    assert list(inspect.signature(record_job_failure).parameters) == ["job", "exc_string", "pipeline"]
    assert "cleanup" in inspect.signature(StartedJobRegistry.get_job_and_execution_ids).parameters
    assert "xx" in inspect.signature(StartedJobRegistry.add_execution).parameters


def test_key_layouts_rqexec_names_through_rq_constants() -> None:
    assert REDIS_WORKER_KEYS == "rq:workers"
    assert WORKERS_BY_QUEUE_KEY % "q" == "rq:workers:q"
    assert BaseWorker.redis_worker_namespace_prefix == "rq:worker:"
    execution = Execution(id="e1", job_id="j1", connection=fake_redis())
    assert execution.composite_key == "j1:e1"  # StartedJobRegistry members: job_id:execution_id


def test_the_command_listener_waits_out_a_lost_redis_without_an_error_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # rq's subscribe() hands its pubsub thread this (overridden) handler
    assert "exception_handler=self._pubsub_exception_handler" in inspect.getsource(BaseWorker.subscribe)
    worker = rqexec.KvrqWorker(["kvrq"], connection=fake_redis())
    pauses: list[float] = []
    monkeypatch.setattr(rqexec.time, "sleep", pauses.append)
    with caplog.at_level(logging.DEBUG):
        worker._pubsub_exception_handler(RedisConnectionError("Connection closed by server."), None, None)  # type: ignore[arg-type]
    assert pauses == [rqexec.COMMAND_LISTENER_RETRY_S], "it pauses before the thread reconnects, as rq's does"
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    # Anything else still ends the thread, as in rq (the handler is called where it was caught).
    with pytest.raises(ValueError):
        try:
            raise ValueError("a bug")
        except ValueError as exc:
            worker._pubsub_exception_handler(exc, None, None)  # type: ignore[arg-type]


def test_a_started_job_is_one_execution_in_the_started_registry() -> None:
    h = Harness()
    job = h.producer.submit({"prompt": "x", "max_tokens": 1000})
    h.loop.run_once()
    (held,) = h.loop.scheduler.all()
    registry = StartedJobRegistry("kvrq", connection=h.redis, serializer="json")
    assert registry.get_job_and_execution_ids(cleanup=False) == [(job.id, held.execution.id)]
    assert h.redis.zscore(registry.key, held.execution.composite_key) is not None
