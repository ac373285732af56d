"""A worker whose liveness key expired while Redis was away (an outage longer than `liveness_ttl`)
is still alive: its own crash check must not take it for dead and re-run the jobs it holds.

On fakeredis: the key is deleted as the outage would have let it expire; the beacon thread is
not running in the harness, as it may not have beaten yet when the loop gets Redis back.
"""

from __future__ import annotations

from producer.protocol import worker_alive_key
from tests.worker.chaos_checks import attempts
from tests.worker.harness import Harness


def test_a_worker_back_from_an_outage_does_not_rerun_its_own_jobs() -> None:
    h = Harness()
    job = h.producer.submit({"prompt": "x", "max_tokens": 20})
    h.run_until(lambda: h.loop.counts["tokens"] >= 3)
    h.redis.delete(worker_alive_key(h.loop.worker.name))  # expired during the outage
    h.loop.next_crash_check = 0.0  # the check is due when the loop gets Redis back
    h.run_until(h.all_ended([job]))
    assert job.status() == "finished"
    assert attempts(h.redis, job.id) == 1
    assert h.loop.counts["dropped"] == 0
