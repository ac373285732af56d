"""A started job whose execution hash holds only a heartbeat does not stop the crash check.

Seen in the queue failover fleet test (tests/fleet/test_fleet_failover.py): a failover's write pause
outlasted the liveness TTL, a worker re-ran a live peer's job (deleting its execution), the peer's next
heartbeat re-created that execution's hash with only `last_heartbeat`, and every worker's crash check
then raised KeyError in rq's Execution.refresh and exited.
"""

from __future__ import annotations

from rq.queue import Queue

from tests.worker.harness import Harness
from worker.fleet.maintenance import rerun_crashed
from worker.jobs import rqexec


def test_a_partial_execution_hash_is_an_orphan_not_a_crash() -> None:
    h = Harness()
    job = h.producer.submit({"prompt": "x", "max_tokens": 1000})
    h.loop.run_once()
    (held,) = h.loop.scheduler.all()
    key = held.execution.key
    h.redis.delete(key)
    h.redis.hset(key, "last_heartbeat", "2026-11-26T14:49:15.000000Z")  # what a late heartbeat leaves
    queue = Queue("kvrq", connection=h.redis, serializer="json")
    (execution,) = rqexec.started_executions(queue)
    assert execution.job_id == job.id
    rerun_crashed(h.redis, ["kvrq"])  # before: KeyError b'created_at'
