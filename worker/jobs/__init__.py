"""The rq job function `worker.jobs.generate`, and the rq side of a kvrq job (rq-facing sub-package).

A kvrq worker never calls `generate`: it reads the job's arguments and batches the request
into its engine. The function exists so rq records a real, importable path for the job,
and so a stock `rq worker` that picks one up fails it with an explanation. Its path is public
(producer.wire.protocol.JOB_FUNCTION): plain rq users enqueue it, and queued jobs name it.

- payload.py: a job's payload as a GenerationRequest (or JobRejected); bounded_job.py: job data
  over its size limit is never inflated;
- rqexec.py: one rq execution per held job (every use of rq internals); scheduled_jobs.py: rq's
  scheduler run inside the loop.
"""

from __future__ import annotations

from typing import Any


def generate(*args: Any, **kwargs: Any) -> dict[str, Any]:
    raise RuntimeError(
        "kvrq jobs are run by `kvrq worker`, which batches them into one model; "
        "a plain `rq worker` cannot run them. Start `kvrq worker --queue <this queue>`."
    )
