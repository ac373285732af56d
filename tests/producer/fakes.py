"""fakeredis connections that rq accepts (fakeredis has no INFO, which rq asks for the server version)."""

from __future__ import annotations

import fakeredis
from redis import Redis


def fake_redis(server: fakeredis.FakeServer | None = None) -> fakeredis.FakeRedis:
    connection = fakeredis.FakeRedis(server=server or fakeredis.FakeServer())
    setattr(connection, "__rq_redis_server_version", (7, 0, 0))  # noqa: B010 - rq caches it under this name
    return connection


def fail_like_rq(
    connection: Redis, job_id: str, exc_string: str, error: dict[str, str] | None = None
) -> None:
    """Mark a queued job failed the way rq records it; `error` goes to job.meta as a kvrq worker writes it."""
    from rq.job import Job, JobStatus
    from rq.results import Result

    from producer.wire.protocol import ERROR_META_KEY

    job = Job.fetch(job_id, connection=connection, serializer="json")
    if error is not None:
        job.meta[ERROR_META_KEY] = error
        job.save_meta()
    with connection.pipeline() as pipe:
        job.set_status(JobStatus.FAILED, pipeline=pipe)
        Result.create_failure(job, ttl=500, exc_string=exc_string, pipeline=pipe)
        pipe.execute()


def result_payload(job_id: str, agent_id: str | None = None, text: str = "Paris.") -> dict[str, object]:
    """A finished job's result as a worker returns it: one prompt token, one answer token."""
    return {
        "job_id": job_id,
        "agent_id": agent_id,
        "text": text,
        "token_ids": [1],
        "finish_reason": "stop",
        "usage": {"prompt_tokens": 1, "reused_tokens": 0, "prefilled_tokens": 1, "generated_tokens": 1},
        "timings": {"queued_s": 0.0, "time_to_first_token_s": 0.1, "total_s": 0.2},
    }


def finish_like_rq(connection: Redis, job_id: str, result: dict[str, object]) -> None:
    """Mark a queued job finished with `result` as its return value, the way rq records it."""
    from rq.job import Job, JobStatus
    from rq.results import Result

    job = Job.fetch(job_id, connection=connection, serializer="json")
    with connection.pipeline() as pipe:
        job.set_status(JobStatus.FINISHED, pipeline=pipe)
        Result.create(job, Result.Type.SUCCESSFUL, ttl=500, return_value=result, pipeline=pipe)
        pipe.execute()


def fake_async_redis(connection: fakeredis.FakeRedis) -> fakeredis.FakeAsyncRedis:
    """A redis.asyncio fakeredis client over `connection`'s server (the same data)."""
    return fakeredis.FakeAsyncRedis(server=connection.connection_pool.connection_kwargs["server"])


def app_connections(connection: fakeredis.FakeRedis | None = None) -> dict[str, object]:
    """create_app's two connections (blocking and asyncio) over one fakeredis server."""
    connection = connection if connection is not None else fake_redis()
    return {"connection": connection, "aio_connection": fake_async_redis(connection)}
