"""Writes confirmed on a replicated Redis (a Sentinel URL): a store put returns only once a replica holds
it, an agent's turn is used only once a replica holds its fence, and job endings a failover dropped are
found (worker/fleet/confirmed_endings.py).

Real redis-server primary + replica + 3 sentinels on loopback (tests/fleet/sentinel.py), the store's
client made by producer/redis_url.connect as the worker makes it. Why it matters: a commit the old
primary acknowledged and had not yet sent to its replica is gone after a failover, and the agent's
next turn would resume from the turn before without a counted miss (the 20-round queue-failover
chaos run caught exactly that).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from redis import Redis
from rq.job import Job

from engine.core.results import Completion
from producer.wire.protocol import JOB_FUNCTION, StreamEvent, agent_fence_key, agent_lock_key, stream_key
from producer.wire.redis_url import connect
from store.errors import StoreError
from store.redis_store import RedisStore
from tests.fleet.sentinel import SentinelTopology, wait_until
from tests.store.conftest import assert_same_cache, make_cache, tiny_spec, tokens
from worker.fleet.agent_turns import AgentTurns
from worker.fleet.confirmed_endings import ConfirmedEndings
from worker.loop.held import HeldJob
from worker.loop.outcomes import Failed, Finished, HandedBack

pytestmark = [pytest.mark.integration]

AGENT = "replicated"


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelTopology]:
    topology = SentinelTopology(tmp_path_factory.mktemp("sentinel")).start()
    try:
        yield topology
    finally:
        topology.stop()


@pytest.fixture
def topology(servers: SentinelTopology) -> SentinelTopology:
    """The module's servers, emptied: for tests that leave the topology as it was."""
    servers.data(servers.primary_port()).flushall()
    return servers


@pytest.fixture
def own_topology(tmp_path: Path) -> Iterator[SentinelTopology]:
    """Servers of the test's own: for tests that kill one or fail over."""
    topology = SentinelTopology(tmp_path).start()
    try:
        yield topology
    finally:
        topology.stop()


def _store(topology: SentinelTopology, **url_options: str) -> RedisStore:
    query = "&".join(f"{k}={v}" for k, v in url_options.items())
    return RedisStore(f"{topology.url}{'?' + query if query else ''}", tiny_spec(), connect=connect)


def _kill_replica(topology: SentinelTopology) -> Redis:
    """kill -9 the replica; returns the primary once it no longer counts it."""
    replica = next(p for p in topology.data_ports if p != topology.primary_port())
    topology._by_port[replica].kill()
    topology._by_port[replica].wait(timeout=10)
    primary = topology.data(topology.primary_port())
    wait_until(lambda: int(primary.info("replication")["connected_slaves"]) == 0, 20, "replica still linked")
    return primary


def _waits(server: Redis) -> int:
    stats: Any = server.info("commandstats")
    return int(stats.get("cmdstat_wait", {}).get("calls", 0))


def test_a_put_waits_for_the_replica_and_the_replica_holds_the_manifest(topology: SentinelTopology) -> None:
    store = _store(topology)
    primary = topology.data(topology.primary_port())
    replica = topology.data(next(p for p in topology.data_ports if p != topology.primary_port()))
    before = _waits(primary)
    cache = make_cache(store.spec, tokens(40, seed=1))
    assert store.put(AGENT, cache, fence=1)
    assert _waits(primary) == before + 1
    manifest = store._mkey(AGENT)
    assert replica.get(manifest) == primary.get(manifest) is not None
    assert_same_cache(store.get(AGENT), cache)
    store.close()


def test_wait_0_in_the_url_turns_the_confirmation_off(topology: SentinelTopology) -> None:
    store = _store(topology, wait="0")
    primary = topology.data(topology.primary_port())
    before = _waits(primary)
    assert store.put(AGENT, make_cache(store.spec, tokens(40, seed=2)), fence=1)
    assert _waits(primary) == before
    store.close()


def test_a_commit_gone_when_read_back_is_written_again(
    topology: SentinelTopology, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a failover does to a commit the replica had not received: the new primary holds the agent's
    previous manifest. Simulated by putting that manifest back between the commit and its read-back."""
    store = _store(topology)
    older, newer = make_cache(store.spec, tokens(30, seed=3)), make_cache(store.spec, tokens(60, seed=3))
    assert store.put(AGENT, older, fence=1)
    primary = topology.data(topology.primary_port())
    previous = primary.get(store._mkey(AGENT))
    commit = store._put
    rolled_back = 0

    def commit_then_roll_back(*args: Any) -> bytes | None:
        nonlocal rolled_back
        written = commit(*args)
        if rolled_back == 0:
            rolled_back += 1
            primary.set(store._mkey(AGENT), previous)
        return written

    monkeypatch.setattr(store, "_put", commit_then_roll_back)
    assert store.put(AGENT, newer, fence=2)
    assert rolled_back == 1 and store.stats()["puts_rewritten"] == 1
    assert_same_cache(store.get(AGENT), newer)
    store.close()


def test_a_put_no_replica_can_confirm_raises_a_store_error_once_its_budget_is_spent(
    own_topology: SentinelTopology,
) -> None:
    """The replica down: the primary (min-replicas-to-write 1) refuses the put, retried until the budget
    is spent; the error says why, and the stored cache is the earlier one, untouched."""
    topology = own_topology
    store = _store(topology)
    older = make_cache(store.spec, tokens(30, seed=4))
    assert store.put(AGENT, older, fence=1)
    _kill_replica(topology)
    store.failover_budget_s = 1.5
    with pytest.raises(StoreError, match="not confirmed on the replicas"):
        store.put(AGENT, make_cache(store.spec, tokens(60, seed=4)), fence=2)
    assert_same_cache(store.get(AGENT), older)
    store.close()


def test_a_primary_left_without_a_replica_keeps_puts_unconfirmed_and_writable(tmp_path: Path) -> None:
    """A store shard run without `min-replicas-to-write` whose replica is gone (promoted, or dead): no
    replica can confirm, so after two tries the put is kept (counted), and the next puts skip the
    confirmation for a while instead of each waiting for it."""
    topology = SentinelTopology(tmp_path, data_config=()).start()
    try:
        store = _store(topology, wait_timeout="300")
        primary = _kill_replica(topology)
        before = _waits(primary)
        assert store.put(AGENT, make_cache(store.spec, tokens(30, seed=6)), fence=1)
        assert _waits(primary) == before + 2
        assert store.stats()["puts_unconfirmed"] == 1
        newer = make_cache(store.spec, tokens(60, seed=6))
        assert store.put(AGENT, newer, fence=2)
        assert _waits(primary) == before + 2  # not asked again
        assert store.stats()["puts_unconfirmed"] == 2
        assert_same_cache(store.get(AGENT), newer)
        store.close()
    finally:
        topology.stop()


def test_after_a_put_spent_its_budget_the_next_gets_one_try(
    own_topology: SentinelTopology, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis refusing every write (the replica gone under min-replicas-to-write): the first put retries
    for its budget; the next ones try once each (a writer thread must not stall a budget per put)."""
    topology = own_topology
    store = _store(topology)
    _kill_replica(topology)
    store.failover_budget_s = 1.0
    put, tries = store._put, [0]

    def counted(*args: Any) -> bytes | None:
        tries[0] += 1
        return put(*args)

    monkeypatch.setattr(store, "_put", counted)
    with pytest.raises(StoreError):
        store.put(AGENT, make_cache(store.spec, tokens(30, seed=7)), fence=1)
    assert tries[0] > 2
    tries[0] = 0
    with pytest.raises(StoreError):
        store.put(AGENT, make_cache(store.spec, tokens(30, seed=8)), fence=2)
    assert tries[0] == 1
    store.close()


@pytest.mark.slow
def test_a_put_during_a_failover_lands_on_the_new_primary(own_topology: SentinelTopology) -> None:
    """SENTINEL FAILOVER while a put is sent: the old primary refuses it (NOREPLICAS, READONLY) or the
    connection drops; the put is retried until the new primary takes it, and then returns."""
    topology = own_topology
    store = _store(topology)
    cache = make_cache(store.spec, tokens(50, seed=5))
    assert store.put(AGENT, make_cache(store.spec, tokens(20, seed=5)), fence=1)
    switched: list[int] = []
    switch = threading.Thread(target=lambda: switched.append(topology.failover()))
    switch.start()
    old = topology.primary_port()
    wait_until(lambda: topology.primary_port() != old, 30, "no new primary announced")
    assert store.put(AGENT, cache, fence=2)
    switch.join(60)
    assert switched, "the failover never finished"
    new_primary = topology.data(switched[0])
    assert new_primary.get(store._mkey(AGENT)) is not None
    assert_same_cache(store.get(AGENT), cache)
    store.close()


def test_taking_an_agent_turn_waits_until_a_replica_holds_its_fence(topology: SentinelTopology) -> None:
    connection = connect(topology.url)
    turns = AgentTurns(connection, "worker-a", ttl_s=30)
    primary = topology.data(topology.primary_port())
    replica = topology.data(next(p for p in topology.data_ports if p != topology.primary_port()))
    before = _waits(primary)
    fence = turns.take(AGENT, "job-1", held_here={"job-1"})
    assert fence == 1
    assert _waits(primary) == before + 1
    assert int(replica.get(agent_fence_key(AGENT)) or 0) == fence


def _held(connection: Redis, job_id: str) -> HeldJob:
    """A held job as far as ConfirmedEndings looks at it: its rq job (its key)."""
    job = Job.create(JOB_FUNCTION, args=({"prompt": "x"},), id=job_id, connection=connection)
    return cast(HeldJob, SimpleNamespace(job=job, id=job_id))


def test_endings_are_asked_about_on_a_replica_and_a_dropped_one_is_handed_back(
    topology: SentinelTopology,
) -> None:
    connection = connect(topology.url)
    primary = topology.data(topology.primary_port())
    endings = ConfirmedEndings(connection)
    kept, dropped, deleted, handed_back = (_held(connection, f"job-{i}") for i in range(4))
    finished = Finished(cast(Completion, None))  # only its kind matters here
    for held, status in ((kept, "finished"), (dropped, "started"), (deleted, None), (handed_back, "queued")):
        if status is not None:
            primary.hset(held.job.key, "status", status)
    endings.written(kept, finished)
    endings.written(dropped, finished)  # as if the failover took its "finished" back: STARTED there
    endings.written(
        deleted, Failed("x", "y", retry=False)
    )  # deleted meanwhile (result_ttl=0): nothing to redo
    endings.written(handed_back, HandedBack())  # not asked about: a requeue is rq's
    before = _waits(primary)
    assert endings.lost() == [(dropped, finished, frozenset({"stream", "rq", "turn"}))]
    assert _waits(primary) == before + 1
    assert endings.lost() == []  # each asked about once


def test_an_ending_a_failover_dropped_in_part_is_handed_back_for_that_part(
    topology: SentinelTopology,
) -> None:
    """The stream's closing and rq's ending are two transactions: a failover may keep either one. Only
    the part that is gone is handed back (a closing written twice reads as a job run twice)."""
    connection = connect(topology.url)
    primary = topology.data(topology.primary_port())
    endings = ConfirmedEndings(connection)
    whole, closed_only, rq_only = (_held(connection, f"part-{i}") for i in range(3))
    finished = Finished(cast(Completion, None))
    for held, status, last in (
        (whole, "finished", StreamEvent("end", finish_reason="length")),
        (closed_only, "started", StreamEvent("end", finish_reason="length")),
        (rq_only, "finished", StreamEvent("delta", text="a", token=1)),
    ):
        primary.hset(held.job.key, "status", status)
        primary.xadd(stream_key(held.id), StreamEvent("start", attempt="x").to_fields())  # type: ignore[arg-type]
        primary.xadd(stream_key(held.id), last.to_fields())  # type: ignore[arg-type]
        endings.written(held, finished)
    assert endings.lost() == [
        (closed_only, finished, frozenset({"rq", "turn"})),
        (rq_only, finished, frozenset({"stream"})),
    ]


def test_endings_on_a_plain_redis_are_not_asked_about(redis_url: str) -> None:
    connection = connect(redis_url)
    endings = ConfirmedEndings(connection)
    endings.written(_held(connection, "plain"), Failed("x", "y", retry=False))
    assert endings.lost() == []


def test_a_turn_release_is_asked_about_on_a_replica_and_made_again_where_dropped(
    topology: SentinelTopology,
) -> None:
    """Two agents' turns released; on the primary one lock is put back as a failover that dropped its
    release leaves it. One WAIT asks about both: only that one is released again."""
    connection = connect(topology.url)
    primary = topology.data(topology.primary_port())
    turns = AgentTurns(connection, "worker-r", ttl_s=30)
    for agent in ("kept-release", "dropped-release"):
        turns.take(agent, f"job-{agent}", held_here=set())
        turns.release(agent, f"job-{agent}")
    primary.set(agent_lock_key("dropped-release"), "worker-r/job-dropped-release", px=30_000)
    before = _waits(primary)
    assert turns.confirm_releases() == 1
    assert _waits(primary) == before + 1  # one WAIT for both
    assert not primary.exists(agent_lock_key("dropped-release"))
    assert turns.confirm_releases() == 0  # the release made again is asked about in its turn
    assert _waits(primary) == before + 2
    assert turns.confirm_releases() == 0 and _waits(primary) == before + 2  # nothing left to ask


def test_turn_releases_on_a_plain_redis_are_not_asked_about(redis_url: str) -> None:
    turns = AgentTurns(connect(redis_url), "worker-plain", ttl_s=30)
    turns.take("plain-agent", "job-1", held_here=set())
    turns.release("plain-agent", "job-1")
    assert turns.confirm_releases() == 0
    assert not turns._released
