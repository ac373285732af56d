"""A job's payload, read and checked before it runs: a GenerationRequest, or JobRejected.

Payload forms a worker accepts (rq JSON serializer):
    queue.enqueue("worker.jobs.generate", {"prompt": "..."})            # documented form
    queue.enqueue("worker.jobs.generate", request={"prompt": "..."})
    queue.enqueue("worker.jobs.generate", prompt="...", max_tokens=8)   # fields as kwargs
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from rq.exceptions import DeserializationError
from rq.job import Job

from producer.models import QUEUE_OPTION_FIELDS, GenerationRequest
from producer.wire.protocol import JOB_FUNCTION
from worker.jobs.bounded_job import BoundedJob


class JobRejected(Exception):
    """This job can never run (bad payload, other function, pickled data): fail it, do not retry."""


def request_from_job(job: Job) -> GenerationRequest:
    """Validate the job's payload as a GenerationRequest, or raise JobRejected with a one-line reason."""
    if isinstance(job, BoundedJob) and job.data_problem is not None:
        raise JobRejected(job.data_problem)
    try:
        func_name, args, kwargs = job.func_name, job.args, job.kwargs
    except DeserializationError:
        raise JobRejected(
            "the job payload is not JSON: enqueue kvrq jobs with serializer=JSONSerializer "
            "(rq.serializers, alias 'json'); kvrq never unpickles job data"
        ) from None
    if func_name != JOB_FUNCTION:
        raise JobRejected(f"this queue runs {JOB_FUNCTION} jobs only, not {func_name}")
    payload = _payload(list(args), dict(kwargs))
    if isinstance(payload, dict) and (options := sorted(QUEUE_OPTION_FIELDS & payload.keys())):
        raise JobRejected(
            f"{', '.join(options)}: rq options, not request fields; the job runs on the queue it was "
            "enqueued to: pass job_timeout=, result_ttl=, retry=Retry(max=N), at_front= to rq's enqueue"
        )
    try:
        return GenerationRequest.model_validate(payload)
    except ValidationError as exc:
        raise JobRejected(f"invalid request: {validation_message(exc)}") from None


def _payload(args: list[Any], kwargs: dict[str, Any]) -> Any:
    if args and kwargs:
        raise JobRejected("pass the request as one positional dict or as keyword arguments, not both")
    if len(args) > 1:
        raise JobRejected(f"expected one positional argument (the request dict), got {len(args)}")
    if args:
        return args[0]
    if set(kwargs) == {"request"}:
        return kwargs["request"]
    if not kwargs:
        raise JobRejected("the job has no request: enqueue it with the request dict as its argument")
    return kwargs


def validation_message(exc: ValidationError, limit: int = 3) -> str:
    """pydantic's errors on one line: `field: message; ...`."""
    parts = []
    for error in exc.errors()[:limit]:
        where = ".".join(str(part) for part in error.get("loc", ())) or "request"
        parts.append(f"{where}: {error.get('msg', 'invalid')}")
    more = len(exc.errors()) - limit
    if more > 0:
        parts.append(f"and {more} more")
    return "; ".join(parts)
