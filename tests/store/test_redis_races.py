"""A RedisStore put that loses its WATCH transaction to another writer retries on a time budget.

The rival is a second store on the same server that commits a put of the same agent between
our WATCH and EXEC, as a busy machine lets a tight-looping writer do over and over (CI saw one
writer lose 8 races in a row to another).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from store import backend
from store.backend import Blob, race_attempts
from store.errors import StoreError
from store.redis_store import RedisStore
from tests.store.conftest import assert_same_cache, make_cache, redis_value_keys, tokens

AGENT = "contested"


def _rival_commits_first(
    store: RedisStore, rival: RedisStore, monkeypatch: pytest.MonkeyPatch, times: int | None
) -> Callable[[], int]:
    """Make the rival put (a new cache each time) inside our next `times` attempts (None: every one);
    returns a count of the rival's puts."""
    original = store._swap_manifest
    puts = 0

    def rival_put_then_swap(tx: object, agent_id: str, *args: Any) -> object:
        nonlocal puts
        if times is None or puts < times:
            puts += 1
            assert rival.put(AGENT, make_cache(rival.spec, tokens(20 + puts, seed=puts)))
        return original(tx, agent_id, *args)

    monkeypatch.setattr(store, "_swap_manifest", rival_put_then_swap)
    return lambda: puts


@pytest.mark.integration
def test_a_put_outlasts_more_lost_races_than_its_minimum_attempts(
    store_and_rival: tuple[RedisStore, RedisStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    store, rival = store_and_rival
    lost = backend.RACE_MIN_ATTEMPTS + 4
    rival_puts = _rival_commits_first(store, rival, monkeypatch, lost)
    mine = make_cache(store.spec, tokens(90, seed=99))
    assert store.put(AGENT, mine)
    assert rival_puts() == lost
    assert store.stats()["put_retries"] == lost
    assert_same_cache(rival.get(AGENT), mine)  # ours committed last: it is what every reader sees


@pytest.mark.integration
def test_a_put_that_loses_every_race_fails_after_its_budget_and_leaves_no_blocks(
    store_and_rival: tuple[RedisStore, RedisStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    store, rival = store_and_rival
    monkeypatch.setattr(backend, "RACE_BUDGET_S", 0.2)
    rival_puts = _rival_commits_first(store, rival, monkeypatch, None)
    started = time.monotonic()
    with pytest.raises(StoreError, match=r"put of agent 'contested' lost \d+ races with other writers"):
        store.put(AGENT, make_cache(store.spec, tokens(90, seed=99)))
    assert time.monotonic() - started >= 0.2
    assert rival_puts() >= backend.RACE_MIN_ATTEMPTS
    manifest = rival.read_manifest(AGENT)
    assert manifest is not None
    stored = redis_value_keys(rival._client, rival.prefix)
    assert stored == set(rival.keys.of_refs(AGENT, manifest.blocks, manifest.part_bytes))  # ours were removed


def test_a_delete_that_loses_a_race_deletes_what_the_winner_stored(
    store_and_rival: tuple[RedisStore, RedisStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The delete is a guarded swap of the manifest to nothing: a put that commits between our WATCH
    and EXEC aborts it, and the retry deletes the newer cache, its blocks and shared blocks too."""
    store, rival = store_and_rival
    assert rival.put(AGENT, make_cache(rival.spec, tokens(40)))
    original = store._delete_manifest
    swaps: list[object] = []

    def rival_puts_first(tx: object, handle: str, current: Blob | None) -> object:
        if not swaps:
            assert rival.put(AGENT, make_cache(rival.spec, tokens(60, seed=2)))
        swaps.append(original(tx, handle, current))
        return swaps[-1]

    monkeypatch.setattr(store, "_delete_manifest", rival_puts_first)
    assert store.delete(AGENT) is True
    assert len(swaps) == 2 and swaps[0] is None and swaps[1] is not None  # aborted, then deleted
    assert rival.get(AGENT) is None and rival.list() == []
    assert redis_value_keys(rival._client, rival.prefix) == set()


def test_race_attempts_make_the_minimum_even_with_no_budget_then_stop() -> None:
    assert list(race_attempts(0.0)) == list(range(1, backend.RACE_MIN_ATTEMPTS + 1))


def test_race_attempts_go_on_past_the_minimum_until_the_budget_is_spent() -> None:
    started = time.monotonic()
    attempts = list(race_attempts(0.5))
    assert time.monotonic() - started >= 0.5
    assert len(attempts) > backend.RACE_MIN_ATTEMPTS
    assert attempts == list(range(1, len(attempts) + 1))


def test_race_attempt_pauses_are_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    pauses: list[float] = []
    monkeypatch.setattr(backend.time, "sleep", pauses.append)
    attempts = race_attempts(0.0)
    for _ in range(backend.RACE_MIN_ATTEMPTS):
        next(attempts)
    assert len(pauses) == backend.RACE_MIN_ATTEMPTS - 1
    assert all(0 <= p <= backend.RACE_PAUSE_CAP_S for p in pauses)
