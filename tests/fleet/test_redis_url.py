"""producer.wire.redis_url: the URL forms, the clients they make, and how refused writes are classified.

The refusal tests use a real redis-server of their own made to refuse writes the way a primary
does during a failover (NOREPLICAS under min-replicas-to-write, READONLY as a replica).
"""

from __future__ import annotations

import time

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.sentinel import SentinelManagedConnection

from producer.wire.redis_url import (
    FailoverConnection,
    FailoverSentinelConnection,
    FailoverSentinelPool,
    FailoverSSLConnection,
    FailoverSSLSentinelConnection,
    PrimaryUnreachableError,
    WriteRefusedError,
    connect,
    is_redis_url,
    parse_sentinel_url,
    replicas_to_wait,
    retry_unsent,
    wait_replicated,
)
from store.factory import open_for_admin
from tests.conftest import RedisServer, free_port


def test_a_sentinel_url_names_its_sentinels_master_db_and_credentials() -> None:
    target = parse_sentinel_url(
        "redis+sentinel://app:s%40cret@10.0.0.1:26380,10.0.0.2,[::1]:26381/mymaster/3"
        "?socket_timeout=2.5&sentinel_password=sp&wait=2&wait_timeout=500"
    )
    assert target.sentinels == (("10.0.0.1", 26380), ("10.0.0.2", 26379), ("::1", 26381))
    assert target.master == "mymaster"
    assert not target.tls
    assert target.options["db"] == 3
    assert target.options["username"] == "app"
    assert target.options["password"] == "s@cret"
    assert target.options["socket_timeout"] == 2.5
    assert target.sentinel_options == {"socket_timeout": 2.5, "password": "sp"}
    assert (target.wait, target.wait_timeout_ms) == (2, 500)


def test_sentinel_url_defaults_db_0_wait_for_one_replica_and_tls_by_scheme() -> None:
    target = parse_sentinel_url("rediss+sentinel://h:1/m")
    assert target.tls
    assert "db" not in target.options  # redis-py's default, 0
    assert (target.wait, target.wait_timeout_ms) == (1, 2000)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis+sentinel://:pw@h:1", "needs /MASTER"),
        ("redis+sentinel://:pw@h:1/m/0/x", "needs /MASTER"),
        ("redis+sentinel://:pw@/m", "names no sentinel"),
        ("redis+sentinel://:pw@h:port/m", "bad sentinel address"),
        ("redis+sentinel://:pw@h:1/m?wait=x", "wait must be a whole number"),
        ("redis+sentinel://:pw@h:1/m/x", "Invalid"),
    ],
)
def test_a_malformed_sentinel_url_is_refused_without_showing_its_password(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as caught:
        parse_sentinel_url(url)
    assert "pw" not in str(caught.value)


def test_connect_refuses_an_unknown_scheme_with_the_forms_it_takes() -> None:
    with pytest.raises(ValueError, match=r"redis\+sentinel://") as caught:
        connect("http://user:pw@host/0")
    assert "pw" not in str(caught.value)
    assert not is_redis_url("http://host")
    assert is_redis_url("rediss+sentinel://h/m") and is_redis_url("unix:///tmp/r.sock")


def test_connect_makes_failover_aware_clients_for_every_form() -> None:
    assert connect("redis://127.0.0.1:1/0").connection_pool.connection_class is FailoverConnection
    assert connect("rediss://127.0.0.1:1/0").connection_pool.connection_class is FailoverSSLConnection
    sentinel = connect("redis+sentinel://127.0.0.1:1/m/2", max_connections=7)
    pool = sentinel.connection_pool
    assert isinstance(pool, FailoverSentinelPool)
    assert pool.connection_class is FailoverSentinelConnection
    assert issubclass(pool.connection_class, SentinelManagedConnection)
    assert pool.connection_kwargs["db"] == 2 and pool.max_connections == 7
    tls = connect("rediss+sentinel://127.0.0.1:1/m").connection_pool
    assert tls.connection_class is FailoverSSLSentinelConnection
    assert replicas_to_wait(sentinel) == (1, 2000)
    assert replicas_to_wait(connect("redis://127.0.0.1:1/0")) == (0, 0)
    assert replicas_to_wait(connect("redis+sentinel://127.0.0.1:1/m?wait=0")) == (0, 2000)


def test_the_urls_own_options_win_over_the_callers_defaults() -> None:
    pool = connect("redis+sentinel://127.0.0.1:1/m?socket_timeout=3", socket_timeout=60).connection_pool
    assert pool.connection_kwargs["socket_timeout"] == 3.0


def test_a_primary_without_its_replicas_refuses_with_an_error_that_is_safe_to_retry(
    own_redis_server: RedisServer,
) -> None:
    admin = connect(own_redis_server.url)
    client = connect(own_redis_server.url)
    client.set("k", 1)
    admin.config_set("min-replicas-to-write", 1)
    with pytest.raises(WriteRefusedError, match="NOREPLICAS"):
        client.set("k", 2)
    assert client.get("k") == b"1"  # reads still work
    admin.config_set("min-replicas-to-write", 0)
    assert client.set("k", 3)


def test_a_demoted_primary_refuses_with_readonly_as_a_retryable_error(own_redis_server: RedisServer) -> None:
    client = connect(own_redis_server.url)
    client.set("k", 1)
    client.replicaof("127.0.0.1", free_port())  # a primary that is gone: this server turns read-only
    try:
        with pytest.raises(WriteRefusedError, match="read only replica"):
            client.set("k", 2)
    finally:
        client.replicaof("NO", "ONE")
    assert client.set("k", 3)


def test_retry_unsent_rides_out_refusals_and_gives_up_after_its_budget() -> None:
    calls: list[float] = []

    def refused_twice() -> str:
        calls.append(time.monotonic())
        if len(calls) <= 2:
            raise WriteRefusedError("NOREPLICAS")
        return "ok"

    assert retry_unsent(refused_twice) == "ok"
    assert len(calls) == 3 and calls[2] - calls[0] >= 0.1  # backed off: 0.05 s, then 0.1 s

    def unreachable() -> None:
        raise PrimaryUnreachableError("no primary")

    started = time.monotonic()
    with pytest.raises(PrimaryUnreachableError):
        retry_unsent(unreachable, budget_s=0.3)
    assert time.monotonic() - started < 1.0

    def lost_reply() -> None:  # a reply lost after sending: the write may have run, so not retried
        calls.append(0.0)
        raise RedisConnectionError("Connection closed by server.")

    calls.clear()
    with pytest.raises(RedisConnectionError):
        retry_unsent(lost_reply)
    assert len(calls) == 1


def test_an_unreachable_server_is_an_unsent_error() -> None:
    with pytest.raises(PrimaryUnreachableError):
        connect(f"redis://127.0.0.1:{free_port()}/0?socket_connect_timeout=1").ping()


def test_wait_replicated_is_a_no_op_for_a_plain_url(own_redis_server: RedisServer) -> None:
    client = connect(own_redis_server.url)
    wait_replicated(client, ["nothing-here"])  # no WAIT, no check: a plain URL asks for none
    assert client.get("kvrq:replication-mark") is None


def test_a_sentinel_store_url_needs_the_workers_connect() -> None:
    with pytest.raises(ValueError, match="connect function"):
        open_for_admin("redis+sentinel://127.0.0.1:1/m")
    store = open_for_admin("redis+sentinel://127.0.0.1:1/m", connect=connect)
    assert store.kind == "redis"
