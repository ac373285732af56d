"""ShardedStore on fakeredis: routing (stable, spread, ~1/N moved when a shard is added), every
operation on the agent's own shard, listing merged across shards, an unreachable shard isolated,
and the `shards:` URL rule."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import fakeredis
import pytest
from redis.exceptions import RedisError

from store.errors import StoreError
from store.factory import open_backend
from store.redis_store import RedisStore
from store.shard_url import parse_shards, redact
from store.sharded import ShardedStore, agent_route_key, pick
from tests.store.conftest import assert_same_cache, make_cache, tiny_spec, tokens

NAMES = ["10.0.0.1:6379/0", "10.0.0.2:6379/0", "10.0.0.3:6379/0"]
AGENTS = [f"agent-{i}" for i in range(3000)]


class Shards:
    """Three RedisStores on three fake servers, and the ShardedStore over them."""

    def __init__(self, **options: object) -> None:
        self.servers = [fakeredis.FakeServer() for _ in NAMES]
        self.clients = [fakeredis.FakeRedis(server=server) for server in self.servers]
        parts = [RedisStore(client, tiny_spec(), **options) for client in self.clients]  # type: ignore[arg-type]
        self.store = ShardedStore(parts, NAMES)

    def holding(self, agent_id: str) -> list[int]:
        """The shards whose server holds a manifest for the agent."""
        return [i for i, part in enumerate(self.store.shards) if part._read_manifest(agent_id) is not None]


@pytest.fixture
def shards() -> Iterator[Shards]:
    made = Shards()
    yield made
    made.store.close()


def test_routing_is_stable_and_independent_of_shard_order() -> None:
    first = [NAMES[pick(NAMES, agent_route_key(a))] for a in AGENTS]
    reordered = list(reversed(NAMES))
    assert [reordered[pick(reordered, agent_route_key(a))] for a in AGENTS] == first
    # Fixed values: a change of the hash would move every agent of every deployed store.
    assert first[:6] == [NAMES[i] for i in (1, 2, 2, 0, 1, 2)]


def test_agents_spread_evenly() -> None:
    counts = Counter(pick(NAMES, agent_route_key(a)) for a in AGENTS)
    assert sorted(counts) == [0, 1, 2]
    assert all(0.29 < n / len(AGENTS) < 0.38 for n in counts.values()), counts


def test_adding_a_shard_moves_about_a_quarter_and_only_to_the_new_one() -> None:
    grown = [*NAMES, "10.0.0.4:6379/0"]
    before = [NAMES[pick(NAMES, agent_route_key(a))] for a in AGENTS]
    after = [grown[pick(grown, agent_route_key(a))] for a in AGENTS]
    moved = [(b, a) for b, a in zip(before, after, strict=True) if b != a]
    assert 0.21 < len(moved) / len(AGENTS) < 0.29, len(moved)
    assert {a for _, a in moved} == {"10.0.0.4:6379/0"}


def test_every_agent_operation_runs_on_the_agent_shard_only(shards: Shards) -> None:
    store = shards.store
    agents = AGENTS[:12]
    caches = {a: make_cache(store.spec, tokens(40, seed=i)) for i, a in enumerate(agents)}
    for agent, cache in caches.items():
        assert store.put(agent, cache, fence=3)
    homes = {a: store.shard_index(a) for a in agents}
    assert len(set(homes.values())) == 3, "12 agents should land on all three shards"
    for agent, cache in caches.items():
        assert shards.holding(agent) == [homes[agent]]
        assert_same_cache(store.get(agent), cache)
        manifest = store.read_manifest(agent)
        assert manifest is not None and manifest.fence == 3
        info = store.info(agent)
        assert info is not None and info.n_tokens == 40
    assert store.put(agents[0], caches[agents[0]], fence=2) is False  # the fence holds, on its shard
    assert store.pin(agents[1]) and store.info(agents[1]).pinned  # type: ignore[union-attr]
    home = shards.clients[homes[agents[1]]]
    assert home.sismember("kvrq:cache:pinned", agents[1])
    assert store.unpin(agents[1]) and not home.sismember("kvrq:cache:pinned", agents[1])
    assert store.delete(agents[2]) and shards.holding(agents[2]) == []
    assert store.get(agents[2]) is None
    stats = store.stats()
    assert stats["puts"] == 12 and stats["hits"] == 12 and stats["stale_puts"] == 1
    assert stats["miss_absent"] == 1 and stats["deletes"] == 1


def test_listing_merges_shards_and_leaves_out_copies_no_get_reads(shards: Shards) -> None:
    store = shards.store
    agents = AGENTS[:9]
    for i, agent in enumerate(agents):
        store.put(agent, make_cache(store.spec, tokens(20, seed=i)))
    assert store.list() == sorted(agents)
    # A copy on a shard the agent does not route to (as left by adding a shard): not listed, not read,
    # and gone with the agent's delete.
    stray = agents[0]
    other = (store.shard_index(stray) + 1) % 3
    store.shards[other].put(stray, make_cache(store.spec, tokens(20, seed=99)))
    assert store.list() == sorted(agents)
    assert_same_cache(store.get(stray), make_cache(store.spec, tokens(20, seed=0)))
    assert store.delete(stray)
    assert shards.holding(stray) == []


def test_anonymous_prefixes_with_one_first_block_share_a_shard(shards: Shards) -> None:
    store = shards.store
    spec = store.spec
    first = tokens(spec.block_tokens, seed=7)
    a = first + tokens(2 * spec.block_tokens, seed=8)
    b = first + tokens(2 * spec.block_tokens, seed=9)
    assert store.prefix_shard(a, None) is store.prefix_shard(b, None)
    assert store.put_prefix(make_cache(spec, a))
    hit = store.get_prefix(b + [1, 2, 3])
    assert hit is not None and hit.token_ids == first  # the shared first block, from the same shard
    homes = [i for i, c in enumerate(shards.clients) if c.zcard("kvrq:cache:prefixes")]
    assert homes == [shards.store.shards.index(store.prefix_shard(a, None))]
    spread = {id(store.prefix_shard(tokens(spec.block_tokens, seed=s), None)) for s in range(30)}
    assert len(spread) == 3, "prefixes of different first blocks should use every shard"


def test_budget_is_split_over_shards_and_enforced_on_each() -> None:
    one = make_cache(tiny_spec(), tokens(40, seed=0))
    made = Shards(max_bytes=3 * one.nbytes)  # each shard: room for about two such agents
    store = made.store
    try:
        for i, agent in enumerate(AGENTS[:30]):
            store.put(agent, make_cache(store.spec, tokens(40, seed=i)))
        store.enforce_budget()
        per_shard = Counter(store.shard_index(a) for a in store.list())
        assert all(n <= 3 for n in per_shard.values()), per_shard
        assert store.stats()["evictions"] >= 30 - 9
    finally:
        store.close()


def test_an_unreachable_shard_is_a_counted_miss_for_its_agents_only(shards: Shards) -> None:
    store = shards.store
    agents = AGENTS[:12]
    caches = {a: make_cache(store.spec, tokens(40, seed=i)) for i, a in enumerate(agents)}
    for agent, cache in caches.items():
        store.put(agent, cache)
    down = store.shard_index(agents[0])
    shards.servers[down].connected = False
    for agent, cache in caches.items():
        if store.shard_index(agent) == down:
            assert store.get(agent, prompt_tokens=cache.token_ids) is None
            with pytest.raises(RedisError):
                store.put(agent, cache)
        else:
            assert_same_cache(store.get(agent, prompt_tokens=cache.token_ids), cache)
    lost = sum(1 for a in agents if store.shard_index(a) == down)
    assert store.stats()["miss_backend_error"] == lost
    with pytest.raises(StoreError, match=f"shard {down + 1} of 3 \\({NAMES[down]}\\)"):
        store.list()


def test_the_url_names_each_shard_by_address_or_given_name() -> None:
    shards = parse_shards(
        "shards:redis://:pw@a:7001/0|redis://b/2?socket_timeout=3|"
        "redis+sentinel://:pw@s1:26379,s2:26380/main/1|redis://c:7003/0?shard=east&socket_timeout=2"
    )
    assert [s.name for s in shards] == ["a:7001/0", "b:6379/2", "sentinel:main/1", "east"]
    assert shards[3].url == "redis://c:7003/0?socket_timeout=2"
    assert shards[0].url == "redis://:pw@a:7001/0"
    # A new password or sentinel address keeps the name (and so every agent where it is).
    again = parse_shards("shards:redis://:other@a:7001/0|redis+sentinel://s9/main/1")
    assert [s.name for s in again] == ["a:7001/0", "sentinel:main/1"]


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("shards:", "names no shard"),
        ("shards:redis://a:1/0|disk:/tmp/x", "is not a Redis URL"),
        ("shards:redis://a:1/0|redis://a:1/0", "twice"),
        ("shards:redis://a:1/0?shard=x|redis://b:1/0?shard=x", "twice"),
    ],
)
def test_malformed_urls_are_refused(uri: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_shards(uri)


def test_errors_never_show_a_password() -> None:
    with pytest.raises(ValueError) as caught:
        parse_shards("shards:redis://:secret1@a:1/0|ftp://u:secret2@b/0")
    assert "secret" not in str(caught.value)
    assert "secret" not in redact("shards:redis://u:secret@a/0?password=secret|redis://b/0")


def test_the_factory_opens_a_sharded_store_with_the_budget_split() -> None:
    uri = "shards:redis://127.0.0.1:1/0|redis://127.0.0.1:2/0|redis://127.0.0.1:3/0"
    store = open_backend(uri, tiny_spec(), max_bytes=300, prefix_max_bytes=30)  # connects on first use
    try:
        assert isinstance(store, ShardedStore)
        assert [s.max_bytes for s in store.shards] == [100, 100, 100]
        assert [s.prefix_max_bytes for s in store.shards] == [10, 10, 10]
        assert store.names == ["127.0.0.1:1/0", "127.0.0.1:2/0", "127.0.0.1:3/0"]
    finally:
        store.close()
    with pytest.raises(ValueError, match="connect function"):
        open_backend("shards:redis://a/0|redis+sentinel://s/m", tiny_spec())
