"""The Redis URL rule (redis_url.py) for asyncio clients: `connect_async(url)` takes the same URL forms,
and its connections turn the same failover replies into the same UNSENT errors, so an async producer
rides out a failover exactly as the blocking one does (`retry_unsent_async`, `wait_replicated_async`).

Only the I/O differs from redis_url.py: the URL parsing, the errors, the budget and the backoff are
that module's, not copies.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from redis.asyncio import Redis
from redis.asyncio.connection import (
    BlockingConnectionPool,
    Connection,
    ConnectionPool,
    SSLConnection,
    parse_url,
)
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool, SentinelManagedConnection
from redis.exceptions import AuthenticationError, AuthorizationError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError

from producer.wire.redis_url import (
    FAILOVER_BUDGET_S,
    REPLICATION_MARK_KEY,
    UNSENT,
    ClientKind,
    PrimaryUnreachableError,
    building,
    check_replicated,
    is_sentinel_url,
    next_wait,
    refused_write,
    take_sentinel_options,
    unsent_waits,
)

T = TypeVar("T")


def connect_async(url: str, *, wait_for_connection: bool = False, **pool_options: Any) -> Redis:
    """An asyncio client for `url` (the forms of redis_url.connect); a malformed URL is a RedisURLError.

    `wait_for_connection`: a command that finds all `max_connections` in use waits for one to come back
    (redis.asyncio's BlockingConnectionPool) instead of failing with "Too many connections": what a
    server whose every open wait holds a connection wants. Plain URLs only (a Sentinel pool fails).
    """
    return building(url, lambda: _client(url, pool_options, wait_for_connection))


def _client(url: str, pool_options: dict[str, Any], wait_for_connection: bool) -> Redis:
    if is_sentinel_url(url):
        client: Redis = ASYNCIO.sentinel_client(url, pool_options)
        return client
    options = ASYNCIO.pool_options(url, pool_options)
    if wait_for_connection:
        options.setdefault("timeout", None)  # as long as it takes: the caller's own timeout bounds it
        return Redis(connection_pool=BlockingConnectionPool.from_url(url, **options))
    return Redis(connection_pool=ConnectionPool.from_url(url, **options))


class _AsyncFailoverAware:
    """redis_url._FailoverAware for asyncio connections: failover replies and failed connects are UNSENT."""

    async def connect(self) -> None:
        try:
            await super().connect()  # type: ignore[misc]
        except (AuthenticationError, AuthorizationError):
            raise
        except RedisConnectionError as exc:
            raise PrimaryUnreachableError(str(exc)) from exc

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().read_response(*args, **kwargs)  # type: ignore[misc]
        except (ResponseError, RedisConnectionError) as exc:
            refused = refused_write(exc)
            if refused is None:
                raise
            await self.disconnect()  # type: ignore[attr-defined]
            raise refused from exc


class AsyncFailoverConnection(_AsyncFailoverAware, Connection):
    pass


class AsyncFailoverSSLConnection(_AsyncFailoverAware, SSLConnection):
    pass


class AsyncFailoverSentinelConnection(_AsyncFailoverAware, SentinelManagedConnection):
    """Asks the sentinels on every connect (redis-py's asyncio one does), so no re-resolve mixin."""


class AsyncFailoverSSLSentinelConnection(_AsyncFailoverAware, SentinelManagedConnection, SSLConnection):
    pass


class AsyncFailoverSentinelPool(SentinelConnectionPool):
    """redis_url.FailoverSentinelPool for asyncio: failover-aware connections, the URL's WAIT setting."""

    def __init__(self, service_name: str, sentinel_manager: Sentinel, **kwargs: Any) -> None:
        take_sentinel_options(
            self, kwargs, AsyncFailoverSentinelConnection, AsyncFailoverSSLSentinelConnection
        )
        super().__init__(service_name, sentinel_manager, **kwargs)


ASYNCIO = ClientKind(
    sentinel=Sentinel,
    sentinel_pool=AsyncFailoverSentinelPool,
    failover={Connection: AsyncFailoverConnection, SSLConnection: AsyncFailoverSSLConnection},
    plain=Connection,
    parse_url=parse_url,
)


async def retry_unsent_async(
    action: Callable[[], Awaitable[T]],
    *,
    budget_s: float = FAILOVER_BUDGET_S,
    errors: tuple[type[Exception], ...] = UNSENT,
) -> T:
    """redis_url.retry_unsent, awaiting: `action()` again with backoff while it fails with `errors`."""
    waits = unsent_waits(budget_s)
    while True:
        try:
            return await action()
        except errors as exc:
            await asyncio.sleep(next_wait(waits, exc, budget_s))


async def wait_replicated_async(connection: Redis, keys: Sequence[str]) -> None:
    """redis_url.wait_replicated for an asyncio client: the same WAIT after a mark, the same errors."""
    pool = connection.connection_pool
    replicas, timeout_ms = getattr(pool, "wait_replicas", 0), getattr(pool, "wait_timeout_ms", 0)
    if replicas <= 0 or not keys:
        return

    async def confirm() -> tuple[int, int]:
        async with connection.pipeline(transaction=False) as pipe:
            pipe.set(REPLICATION_MARK_KEY, b"1", px=60_000)
            pipe.execute_command("WAIT", replicas, timeout_ms)
            pipe.exists(*keys)
            _, confirmed, present = await pipe.execute()
        return int(confirmed), int(present)

    confirmed, present = await retry_unsent_async(confirm)
    check_replicated(len(keys), present, confirmed, replicas, timeout_ms)
