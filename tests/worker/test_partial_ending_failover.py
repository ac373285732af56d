"""A failover that keeps one half of a job's ending and drops the other (worker/fleet/confirmed_endings.py).

The stream's closing event and the rq ending are two transactions, one after the other. A failover can
cut between them: the new primary then holds the one the replica had received and not the other. The
worker writes again only the half that is gone, so the job ends with one result and one stream closing
(tests/fleet/test_fleet_failover.py counts a second closing as a job delivered twice).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from rq.job import Job
from rq.serializers import JSONSerializer

from producer.client import JobHandle
from producer.wire.protocol import StreamEvent, stream_key
from tests.worker.harness import Harness, stored_events
from worker.jobs import rqexec


@pytest.fixture
def h() -> Iterator[Harness]:
    yield Harness()


def _results(h: Harness, handle: JobHandle) -> int:
    return len(Job(handle.id, connection=h.redis, serializer=JSONSerializer).results())


def _failover_at_read_back(h: Harness, monkeypatch: pytest.MonkeyPatch, drop: Any) -> list[bool]:
    """The loop's WAIT is answered by a replica; just before, `drop()` changes the server as the failover
    left it (once). Returns the list that holds True once that happened."""
    h.loop.confirmed._written.replicas = 1  # as on a Sentinel URL's `wait=1`
    failovers: list[bool] = []

    def read_after_failover(
        connection: Any, replicas: int, timeout_ms: int, reads: Any
    ) -> tuple[int, list[Any]]:
        if not failovers and drop():
            failovers.append(True)
        with connection.pipeline(transaction=False) as pipe:
            reads(pipe)
            return 1, pipe.execute()

    monkeypatch.setattr("worker.fleet.replica_reads.read_after_wait", read_after_failover)
    return failovers


def test_a_failover_that_kept_the_streams_closing_but_dropped_the_rq_ending_closes_the_stream_once(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server as it was between the two transactions (a snapshot taken as rq's finish begins) comes
    back at the read-back: the job is STARTED there, its stream already closed. The rq ending is written
    again; the closing is not (it was twice, which a chaos check counts as a job run twice)."""
    handle = h.producer.submit({"prompt": "x", "max_tokens": 3})
    snapshot: dict[Any, Any] = {}
    finish_job = rqexec.finish_job

    def snapshot_then_finish(*args: Any) -> bool:
        if not snapshot:
            keys: Any = h.redis.keys("*")
            snapshot.update({key: h.redis.dump(key) for key in keys})
        return finish_job(*args)

    def restore() -> bool:
        if not snapshot:
            return False
        h.redis.flushall()
        for key, value in snapshot.items():
            h.redis.restore(key, 0, value)
        return True

    monkeypatch.setattr(rqexec, "finish_job", snapshot_then_finish)
    failovers = _failover_at_read_back(h, monkeypatch, restore)
    h.run_until(lambda: bool(failovers) and not h.loop.ending and handle.status() == "finished")
    h.loop.run_once()  # the rewrite's own read-back: nothing more to redo
    assert h.loop.counts["endings_rewritten"] == 1
    assert [e.kind for e in stored_events(h, handle)].count("end") == 1
    assert stored_events(h, handle)[-1].kind == "end"
    assert _results(h, handle) == 1
    assert handle.result(timeout=1).text == "abc"
    assert h.loop.counts["finished"] == 1


def test_a_failover_that_kept_the_rq_ending_but_dropped_the_streams_closing_closes_the_stream_again(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The closing was acknowledged by the old primary and never reached the replica; rq's ending, refused
    there, went to the new primary. The job is FINISHED, but a stream reader would wait for a closing
    that never comes: the loop writes it again, and nothing of rq's."""
    handle = h.producer.submit({"prompt": "x", "max_tokens": 3})

    def drop_closing() -> bool:
        entries: Any = h.redis.xrange(stream_key(handle.id))
        if not entries or not StreamEvent.from_fields(entries[-1][1]).final:
            return False
        h.redis.xdel(stream_key(handle.id), entries[-1][0])
        return True

    failovers = _failover_at_read_back(h, monkeypatch, drop_closing)
    h.run_until(lambda: bool(failovers) and not h.loop.ending and stored_events(h, handle)[-1].final)
    h.loop.run_once()
    assert h.loop.counts["endings_rewritten"] == 1
    assert [e.kind for e in stored_events(h, handle)] == ["start", "delta", "delta", "delta", "end"]
    assert "".join(handle.stream(timeout=1)) == "abc"
    assert _results(h, handle) == 1
    assert handle.status() == "finished"
    assert h.loop.counts["finished"] == 1
    assert h.loop.counts["dropped"] == 0
