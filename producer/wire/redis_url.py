"""The one owner of kvrq's Redis URL rule: `connect(url)` for every client kvrq opens.

Forms (the plain ones are redis-py's own, so `?socket_timeout=...` and the like work in all):

    redis://[user:pass@]host:port/db      rediss://... (TLS)      unix:///path.sock?db=N
    redis+sentinel://[user:pass@]s1:26379,s2:26379,s3:26379/MASTER[/db][?options]
    rediss+sentinel://...                 the same, TLS to the sentinels and the primary

A Sentinel URL names the sentinels (port 26379 when left out) and the master's name; the client
asks them for the current primary and asks again whenever a connection is made. Its user and
password are the primary's; sentinels that have a password of their own take
`?sentinel_username=...&sentinel_password=...`. `?wait=N&wait_timeout=MS` (defaults 1 and 2000
for Sentinel URLs, 0 for plain ones) is the number of replicas an enqueue waits for (Redis `WAIT`)
before the producer reports it done: see docs/scale-out.md.

Connections made here treat a READONLY, NOREPLICAS or UNBLOCKED reply as an outage: they disconnect
(a Sentinel connection then finds the new primary on its next connect) and raise WriteRefusedError, a
redis-py ConnectionError, which every caller already waits out with backoff. A demoted primary answers
READONLY; one that lost its replica under `min-replicas-to-write` answers NOREPLICAS. Why: a failover
otherwise loses writes clients were told had succeeded (docs/scale-out.md, "What makes a failover
lose nothing").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

from redis import Redis
from redis.connection import Connection, ConnectionPool, SSLConnection, parse_url
from redis.exceptions import AuthenticationError, AuthorizationError, ReadOnlyError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.sentinel import Sentinel, SentinelConnectionPool, SentinelManagedConnection

from producer.wire.redact import redact_url

T = TypeVar("T")
log = logging.getLogger("kvrq.redis")

SENTINEL_SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}  # scheme -> TLS
DEFAULT_SENTINEL_PORT = 26379
DEFAULT_WAIT_TIMEOUT_MS = 2000
#: Replies of a server that is not (or no longer) the writable primary; none of them ran the command.
#: UNBLOCKED: a blocking read (BLMOVE, ...) on a primary that turned replica.
_FAILOVER_REPLIES = ("READONLY", "NOREPLICAS", "UNBLOCKED")
#: Socket timeouts of a Sentinel client unless the caller or the URL set them: during a failover a read
#: was seen to wait for a reply that never came (no socket timeout by default in redis-py); with one it
#: fails as a TimeoutError after this long, and callers retry it on the new primary.
SENTINEL_SOCKET_DEFAULTS = {"socket_timeout": 10.0, "socket_connect_timeout": 5.0}
#: The key `wait_replicated` writes before its WAIT.
REPLICATION_MARK_KEY = "kvrq:replication-mark"
#: Query options read here; the rest go to redis-py like those of a plain URL.
_OWN_OPTIONS = ("sentinel_username", "sentinel_password", "wait", "wait_timeout")
#: Options of a data connection that a sentinel connection shares (timeouts and TLS settings).
_SHARED_PREFIXES = ("socket_", "ssl_")


@dataclass(frozen=True)
class SentinelTarget:
    """A parsed Sentinel URL."""

    sentinels: tuple[tuple[str, int], ...]
    master: str
    tls: bool
    options: dict[str, Any] = field(default_factory=dict)  # db, username, password, socket_timeout, ...
    sentinel_options: dict[str, Any] = field(default_factory=dict)
    wait: int = 1
    wait_timeout_ms: int = DEFAULT_WAIT_TIMEOUT_MS


def is_sentinel_url(url: str) -> bool:
    return url.partition("://")[0].lower() in SENTINEL_SCHEMES


def is_redis_url(url: str) -> bool:
    """Whether `url` is one of the forms `connect` takes."""
    return url.startswith(("redis://", "rediss://", "unix://")) or is_sentinel_url(url)


def parse_sentinel_url(url: str) -> SentinelTarget:
    """The parts of a `redis+sentinel://` URL; ValueError (password masked) when it is malformed."""
    shown = redact_url(url)
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in SENTINEL_SCHEMES:
        raise ValueError(f"not a Sentinel URL: {shown!r} (redis+sentinel://HOST:PORT,.../MASTER[/DB])")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    sentinels = tuple(_host_port(item, shown) for item in hosts.split(",") if item.strip())
    if not sentinels:
        raise ValueError(f"Sentinel URL {shown!r} names no sentinel")
    path = [unquote(p) for p in parts.path.split("/") if p]
    if not path or len(path) > 2:
        raise ValueError(f"Sentinel URL {shown!r} needs /MASTER or /MASTER/DB after the sentinels")
    query = dict(parse_qsl(parts.query, keep_blank_values=False))
    own = {name: query.pop(name) for name in _OWN_OPTIONS if name in query}
    # redis-py parses the rest (types included) as it would for a plain URL to the primary.
    plain = f"{'rediss' if SENTINEL_SCHEMES[scheme] else 'redis'}://{userinfo + '@' if userinfo else ''}x"
    if len(path) == 2:
        query.setdefault("db", path[1])
    try:
        options = parse_url(f"{plain}/?{urlencode(query)}" if query else plain)
    except ValueError as exc:
        raise ValueError(f"Sentinel URL {shown!r}: {exc}") from None
    options.pop("host", None)
    options.pop("connection_class", None)
    sentinel_options = {k: v for k, v in options.items() if k.startswith(_SHARED_PREFIXES)}
    for name in ("username", "password"):
        if f"sentinel_{name}" in own:
            sentinel_options[name] = own[f"sentinel_{name}"]
    return SentinelTarget(
        sentinels=sentinels,
        master=path[0],
        tls=SENTINEL_SCHEMES[scheme],
        options=options,
        sentinel_options=sentinel_options,
        wait=_count(own.get("wait", "1"), "wait", shown),
        wait_timeout_ms=_count(own.get("wait_timeout", str(DEFAULT_WAIT_TIMEOUT_MS)), "wait_timeout", shown),
    )


class RedisURLError(ValueError):
    """A Redis URL that cannot be used as written (scheme, port, options); the message names the
    problem, password masked. `kvrq` commands print it as one line and exit 2."""


def connect(url: str, **pool_options: Any) -> Redis:
    """A client for `url` (any form above); `pool_options` as for redis-py's pools (max_connections,
    socket_timeout, command_packer, ...), where the URL's own options win. Nothing is sent until used;
    a malformed URL is a RedisURLError."""
    return building(url, lambda: _client(url, pool_options))


def building(url: str, make: Callable[[], T]) -> T:
    """`make()`, a client for `url`: building one parses only, so every ValueError is the URL's."""
    try:
        return make()
    except RedisURLError:
        raise
    except ValueError as exc:
        raise RedisURLError(f"bad Redis URL {redact_url(url)!r}: {exc}") from None


def check_plain_url(url: str) -> None:
    """Refuse a URL that is neither Sentinel nor one redis-py's pools take as meant (both clients)."""
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise RedisURLError(
            f"unknown Redis URL {redact_url(url)!r}: use redis://, rediss://, unix:// or "
            "redis+sentinel://HOST:PORT,.../MASTER"
        )
    if not url.startswith("unix://") and urlsplit(url).port == 0:  # .port: ValueError when out of range
        raise ValueError("port 0 (redis-py would silently use 6379)")


def _client(url: str, pool_options: dict[str, Any]) -> Redis:
    if is_sentinel_url(url):
        client: Redis = BLOCKING.sentinel_client(url, pool_options)
        return client
    return Redis(connection_pool=ConnectionPool.from_url(url, **BLOCKING.pool_options(url, pool_options)))


@dataclass(frozen=True)
class ClientKind:
    """The redis-py classes a kvrq client is built from, blocking or asyncio (redis_url_aio.py), so both
    follow one rule: failover-aware connections, and for a Sentinel URL its sentinels and WAIT setting."""

    sentinel: Callable[..., Any]  # redis-py's Sentinel
    sentinel_pool: type  # the failover-aware pool of a Sentinel primary
    failover: dict[type, type]  # redis-py's plain and TLS connection class -> the failover-aware one
    plain: type  # the connection class a URL that names none gets
    parse_url: Callable[[str], Any]  # redis-py's parse_url: the options a plain URL names

    def sentinel_client(self, url: str, pool_options: dict[str, Any]) -> Any:
        target = parse_sentinel_url(url)
        options, sentinel_options = sentinel_options_of(target, pool_options)
        manager = self.sentinel(list(target.sentinels), sentinel_kwargs=sentinel_options)
        return manager.master_for(
            target.master,
            connection_pool_class=self.sentinel_pool,
            ssl=target.tls,
            wait_replicas=target.wait,
            wait_timeout_ms=target.wait_timeout_ms,
            **options,
        )

    def pool_options(self, url: str, pool_options: dict[str, Any]) -> dict[str, Any]:
        """A plain URL's pool options: the failover-aware connection class unless the caller names one."""
        check_plain_url(url)
        connection_class = self.parse_url(url).get("connection_class", self.plain)
        options = {**pool_options}
        if connection_class in self.failover and "connection_class" not in options:
            options["connection_class"] = self.failover[connection_class]
        return options


def sentinel_options_of(target: SentinelTarget, pool_options: dict[str, Any]) -> tuple[dict, dict]:
    """(the primary's connection options, the sentinels' own) for a Sentinel URL's client."""
    options = {**SENTINEL_SOCKET_DEFAULTS, **pool_options, **target.options}
    sentinel_options = {k: v for k, v in options.items() if k.startswith(_SHARED_PREFIXES)}
    sentinel_options.update(target.sentinel_options)
    if target.tls:
        sentinel_options["ssl"] = True
    return options, sentinel_options


class WriteRefusedError(RedisConnectionError):
    """The server refused a command as not the writable primary (READONLY, NOREPLICAS): nothing ran."""


class PrimaryUnreachableError(RedisConnectionError):
    """No connection to the primary could be made (or Sentinel knows none yet): nothing was sent."""


class NotReplicatedError(RedisConnectionError):
    """Written on the primary, but fewer replicas than the URL's `wait` confirmed it in time."""


#: Errors after which nothing was run, so a write may be sent again as it is.
UNSENT = (WriteRefusedError, PrimaryUnreachableError)
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
#: Redis is away for now (down, or failing over: a failover closes every client's connection, and a
#: refused write is a ConnectionError there); a read may simply be sent again.
REDIS_DOWN: tuple[type[Exception], ...] = (RedisConnectionError, RedisTimeoutError)
#: How long `retry_unsent` keeps trying. Sentinel announces a new primary within seconds; with one replica
#: and min-replicas-to-write 1 it takes writes once the old primary rejoins as its replica (10-20 s).
FAILOVER_BUDGET_S = 30.0
#: A worker's confirmations of what it wrote (job endings, agent-turn releases): the longest one WAIT may
#: hold its loop (a replica lagging past it is asked again later), and the pause before asking again.
CONFIRM_WAIT_MS = 500
CONFIRM_RETRY_S = 1.0


def retry_unsent(
    action: Callable[[], T],
    *,
    budget_s: float = FAILOVER_BUDGET_S,
    errors: tuple[type[Exception], ...] = UNSENT,
) -> T:
    """`action()`, tried again with backoff while it fails with `errors`, for up to `budget_s`.

    UNSENT (the default) are safe to retry for any command; pass REDIS_DOWN for reads only.
    """
    waits = unsent_waits(budget_s)
    while True:
        try:
            return action()
        except errors as exc:
            time.sleep(next_wait(waits, exc, budget_s))


def unsent_waits(budget_s: float) -> Iterator[float]:
    """The waits between tries of a command Redis did not run: 0.05 s doubling to 1 s, while the next
    try still starts within `budget_s` of the first (checked as each wait is taken)."""
    deadline = time.monotonic() + budget_s
    delay = 0.05
    while time.monotonic() + delay <= deadline:
        yield delay
        delay = min(delay * 2, 1.0)


def next_wait(waits: Iterator[float], exc: Exception, budget_s: float) -> float:
    """The wait before trying again after `exc`, or `exc` raised again once the budget is spent; the
    first failure is logged (once per call: a wrong URL should not look like a hang)."""
    delay = next(waits, None)
    if delay is None:
        raise exc
    if delay == 0.05:
        log.warning("Redis primary unavailable (%s): retrying for up to %.0f s", exc, budget_s)
    return delay


def replicas_to_wait(connection: Redis) -> tuple[int, int]:
    """(replicas, timeout in ms) an enqueue on `connection` waits for: (0, 0) unless its URL asks."""
    pool = getattr(connection, "connection_pool", None)
    return (getattr(pool, "wait_replicas", 0), getattr(pool, "wait_timeout_ms", 0))


def read_after_wait(
    connection: Redis, replicas: int, timeout_ms: int, reads: Callable[[Any], object]
) -> tuple[int, list[Any]]:
    """(replicas that hold every write made so far, the replies of `reads`), in one round trip.

    WAIT counts the writes of its own connection, which need not be the one that wrote what matters:
    so it follows a small write of its own, which lies after theirs in the replication stream.
    `reads(pipe)` queues the reads to make once WAIT returned.
    """
    with connection.pipeline(transaction=False) as pipe:
        pipe.set(REPLICATION_MARK_KEY, b"1", px=60_000)
        pipe.execute_command("WAIT", replicas, timeout_ms)
        reads(pipe)
        _, confirmed, *replies = pipe.execute()
    return int(confirmed), replies


def wait_replicated(connection: Redis, keys: Sequence[str]) -> None:
    """Return once `keys` (just written) are on the primary and on the replicas the URL's `wait` asks
    for; raise NotReplicatedError when that cannot be confirmed. A no-op for plain URLs.

    After the WAIT (`read_after_wait`) it checks that `keys` exist there (a failover in between may
    have dropped them: then they do not).
    """
    replicas, timeout_ms = replicas_to_wait(connection)
    if replicas <= 0 or not keys:
        return

    def confirm() -> tuple[int, int]:
        confirmed, (present,) = read_after_wait(connection, replicas, timeout_ms, lambda p: p.exists(*keys))
        return confirmed, int(present)

    confirmed, present = retry_unsent(confirm)
    check_replicated(len(keys), present, confirmed, replicas, timeout_ms)


def check_replicated(written: int, present: int, confirmed: int, replicas: int, timeout_ms: int) -> None:
    """NotReplicatedError unless all `written` keys are still there and `replicas` replicas confirmed them
    (the verdict of wait_replicated, shared with its asyncio twin in redis_url_aio.py)."""
    if present < written:
        raise NotReplicatedError(
            f"{written - present} of {written} written key(s) are gone: the primary failed over "
            "before they reached a replica (resubmit them)"
        )
    if confirmed < replicas:
        raise NotReplicatedError(
            f"written, but confirmed by {confirmed} of {replicas} replica(s) within {timeout_ms} ms: "
            "it may be lost if the primary fails now (resubmitting with the same job ids is safe)"
        )


def is_failover_reply(exc: BaseException) -> bool:
    """A reply that means "not the writable primary now": READONLY, NOREPLICAS (min-replicas), UNBLOCKED."""
    return isinstance(exc, ReadOnlyError) or (
        isinstance(exc, ResponseError) and str(exc).startswith(_FAILOVER_REPLIES)
    )


def refused_write(exc: Exception) -> WriteRefusedError | None:
    """The UNSENT error a reply stands for when the server is no longer the writable primary (a failover
    reply, or redis-py's own notice for READONLY on a Sentinel connection), else None. The connection
    is then disconnected (a no-op after redis-py's notice) so its next connect finds the new primary."""
    if isinstance(exc, ResponseError) and is_failover_reply(exc):
        return WriteRefusedError(f"Redis primary refused a write ({exc}): reconnecting")
    if isinstance(exc, RedisConnectionError) and str(exc) == "The previous master is now a slave":
        return WriteRefusedError(f"Redis primary was demoted ({exc}): reconnecting")
    return None


class _FailoverAware:
    """Failover replies and failed connects become UNSENT errors (see the module docstring)."""

    def connect(self) -> None:
        try:
            super().connect()  # type: ignore[misc]
        except (AuthenticationError, AuthorizationError):
            raise
        except RedisConnectionError as exc:
            raise PrimaryUnreachableError(str(exc)) from exc

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().read_response(*args, **kwargs)  # type: ignore[misc]
        except (ResponseError, RedisConnectionError) as exc:
            refused = refused_write(exc)
            if refused is None:
                raise
            self.disconnect()  # type: ignore[attr-defined]
            raise refused from exc


class FailoverConnection(_FailoverAware, Connection):
    pass


class FailoverSSLConnection(_FailoverAware, SSLConnection):
    pass


class _ResolvesOnReconnect:
    """A Sentinel connection that asks the sentinels again whenever it reconnects.

    redis-py's re-resolves only when the pool hands a connection out; one that drops while checked
    out (a pipeline watching keys) reconnected to its old address: the demoted primary, for good.
    """

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if not self._sock:  # type: ignore[attr-defined]
            self.connect()  # type: ignore[attr-defined]
        super().send_packed_command(command, check_health)  # type: ignore[misc]


class FailoverSentinelConnection(_FailoverAware, _ResolvesOnReconnect, SentinelManagedConnection):
    pass


class FailoverSSLSentinelConnection(
    _FailoverAware, _ResolvesOnReconnect, SentinelManagedConnection, SSLConnection
):
    pass


class FailoverSentinelPool(SentinelConnectionPool):
    """A Sentinel pool of failover-aware connections that also carries the URL's WAIT setting."""

    def __init__(self, service_name: str, sentinel_manager: Sentinel, **kwargs: Any) -> None:
        take_sentinel_options(self, kwargs, FailoverSentinelConnection, FailoverSSLSentinelConnection)
        super().__init__(service_name, sentinel_manager, **kwargs)


BLOCKING = ClientKind(
    sentinel=Sentinel,
    sentinel_pool=FailoverSentinelPool,
    failover={Connection: FailoverConnection, SSLConnection: FailoverSSLConnection},
    plain=Connection,
    parse_url=parse_url,
)


def take_sentinel_options(pool: Any, kwargs: dict[str, Any], plain: type, tls: type) -> None:
    """Move the URL's WAIT setting out of a Sentinel pool's `kwargs` onto `pool`, and pick its
    connection class (`tls` where the URL asked for TLS): the blocking and the asyncio pool alike."""
    pool.wait_replicas = int(kwargs.pop("wait_replicas", 0))
    pool.wait_timeout_ms = int(kwargs.pop("wait_timeout_ms", 0))
    kwargs.setdefault("connection_class", tls if kwargs.pop("ssl", False) else plain)


def _host_port(item: str, shown: str) -> tuple[str, int]:
    host, colon, port = item.strip().rpartition(":")
    if not colon or "]" in port:  # no port given (an IPv6 literal ends in "]")
        host, port = item.strip(), str(DEFAULT_SENTINEL_PORT)
    host = host.strip("[]")
    if not host or not port.isdigit():
        raise ValueError(f"Sentinel URL {shown!r}: bad sentinel address {item!r} (want HOST:PORT)")
    return host, int(port)


def _count(value: str, name: str, shown: str) -> int:
    if not value.isdigit():
        raise ValueError(f"Sentinel URL {shown!r}: {name} must be a whole number, got {value!r}")
    return int(value)
