"""Fuzzed payloads through plain rq, on the fakeredis harness: each bad job fails alone with a
one-line reason naming what is wrong, and the worker keeps answering good jobs between them.

The same generator (tests/worker/fuzz_jobs.py) runs against a real `kvrq worker` in
test_integration_outages.py (a few dozen by default, 1,000 with `-m chaos`).
"""

from __future__ import annotations

from collections import Counter

import pytest
from rq import Queue
from rq.serializers import JSONSerializer

from producer.wire.protocol import JOB_FUNCTION
from tests.worker.fuzz_jobs import FAMILIES, enqueue, failure_problem, fuzz_cases
from tests.worker.harness import Harness

GOOD = {"prompt": "hello", "max_tokens": 3}


def test_fuzzed_payloads_each_fail_alone_with_a_reason_naming_the_field() -> None:
    h = Harness()
    cases = fuzz_cases(100, seed=11)
    assert len(Counter(case.family for case in cases)) == len(FAMILIES)
    bad, good = [], []
    for index, case in enumerate(cases):
        bad.append((case, h.producer.handle(enqueue(case, h.redis).id)))
        if index % 10 == 9:  # good jobs in between: a bad neighbour costs them nothing
            good.append(h.producer.submit(GOOD))
    h.run_until(h.all_ended([handle for _, handle in bad] + good), 2000)
    problems = [f"{case.describe()}: {p}" for case, handle in bad if (p := failure_problem(case, handle))]
    assert problems == []
    assert [g.result(timeout=1).text for g in good] == ["abc"] * len(good)
    assert h.loop.counts["failed"] == len(bad)
    after = h.producer.submit(GOOD)  # the worker stays up
    h.run_until(h.all_ended([after]))
    assert after.result(timeout=1).text == "abc"


@pytest.mark.parametrize("junk", ["soon", [1], {"t": 1}])
def test_junk_in_kvrqs_job_meta_does_not_stop_the_worker(junk: object) -> None:
    h = Harness()
    queue = Queue("kvrq", connection=h.redis, serializer=JSONSerializer)
    odd = h.producer.handle(
        queue.enqueue_call(JOB_FUNCTION, args=(GOOD,), meta={"kvrq_first_enqueued_at": junk}).id
    )
    good = h.producer.submit(GOOD)
    h.run_until(h.all_ended([odd, good]))
    assert odd.result(timeout=1).text == good.result(timeout=1).text == "abc"


def test_a_pickled_job_with_meta_fails_only_that_job() -> None:
    h = Harness()
    pickled = Queue("kvrq", connection=h.redis).enqueue_call(JOB_FUNCTION, args=(GOOD,), meta={"a": 1})
    odd = h.producer.handle(pickled.id)
    good = h.producer.submit(GOOD)
    h.run_until(h.all_ended([odd, good]))
    assert odd.status() == "failed"
    assert good.result(timeout=1).text == "abc"
