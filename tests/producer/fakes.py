"""fakeredis connections that rq accepts (fakeredis has no INFO, which rq asks for the server version)."""

from __future__ import annotations

import fakeredis


def fake_redis(server: fakeredis.FakeServer | None = None) -> fakeredis.FakeRedis:
    connection = fakeredis.FakeRedis(server=server or fakeredis.FakeServer())
    setattr(connection, "__rq_redis_server_version", (7, 0, 0))  # noqa: B010 - rq caches it under this name
    return connection
