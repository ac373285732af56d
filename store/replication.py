"""A store write confirmed on replicas, so a failover cannot take back a cache a worker called durable.

A worker frees an agent's lock once its put returns, and the agent's next turn (on any worker) reads
the store. A commit the old primary acknowledged but had not yet sent to its replica is gone once the
replica is promoted: the next turn then resumes from the turn before, a true prefix (the answer is
right) but a miss nobody counted. Where the client's pool asks for replicas (`wait_replicas`, set by
producer/wire/redis_url.connect from a Sentinel URL's `?wait=`), a
put is confirmed with WAIT and read back; refused writes and lost connections are retried for as long
as a failover takes (FAILOVER_BUDGET_S, the producer's budget too).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

#: How long puts skip the confirmation once no replica confirmed one (a primary without replicas).
UNREPLICATED_HOLD_S = 30.0


@dataclass(frozen=True)
class Replication:
    """How many replicas a write must reach, and how long one WAIT may take."""

    replicas: int
    timeout_ms: int

    @classmethod
    def of(cls, client: Any) -> Replication:
        """What `client`'s pool asks for: no replicas unless its URL said so."""
        pool = getattr(client, "connection_pool", None)
        return cls(int(getattr(pool, "wait_replicas", 0) or 0), int(getattr(pool, "wait_timeout_ms", 0) or 0))


@dataclass(frozen=True)
class Confirmation:
    """What a replica-confirmed read of one key found."""

    replicas: int  # replicas that hold every write made before the read
    value: bytes | None  # the key's value on the primary now


def confirm(client: Any, key: str, mark_key: str, replication: Replication) -> Confirmation:
    """WAIT for the replicas, then read `key` back.

    WAIT counts the writes of its own connection, which need not be the one that wrote `key`: so it
    follows a small write of its own (`mark_key`), which lies after theirs in the replication stream.
    """
    with client.pipeline(transaction=False) as pipe:
        pipe.set(mark_key, b"1", px=60_000)
        pipe.execute_command("WAIT", replication.replicas, replication.timeout_ms)
        pipe.get(key)
        _, replicas, value = pipe.execute()
    return Confirmation(int(replicas), None if value is None else bytes(value))


def backoff(budget_s: float) -> Iterator[float]:
    """Pauses before each try: 0 for the first, then 0.05 s doubling to 1 s while `budget_s` lasts
    (a budget of 0: one try)."""
    deadline = time.monotonic() + budget_s
    yield 0.0
    delay = 0.05
    while time.monotonic() + delay <= deadline:
        yield delay
        delay = min(delay * 2, 1.0)
