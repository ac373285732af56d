"""RecentPrefixes: whole caches of recent agent-less jobs, matched token by token, per namespace."""

from __future__ import annotations

import numpy as np

from engine.core.blocks import AgentCache, KVBlock
from tests.worker.fakes import SPEC
from tests.worker.harness import Harness
from worker.loop.recent_prefixes import RecentPrefixes


def cache_of(tokens: list[int]) -> AgentCache:
    """A cache whose KV value at each position is its token id (4-token blocks, as the fake's spec)."""
    blocks = []
    for start in range(0, len(tokens), SPEC.block_tokens):
        chunk = np.asarray(tokens[start : start + SPEC.block_tokens], dtype=np.float32)[None, :, None]
        blocks.append(KVBlock(keys=(chunk,), values=(chunk.copy(),)))
    return AgentCache(SPEC, list(tokens), blocks)


def test_the_longest_token_prefix_wins_and_is_cut_there() -> None:
    recent = RecentPrefixes(1 << 20)
    recent.add(cache_of([1, 2, 3, 4, 5, 6, 7]), "t")
    recent.add(cache_of([1, 2, 9, 9, 9]), "t")
    found = recent.longest([1, 2, 3, 4, 5, 8, 8], "t")
    assert found is not None and found.token_ids == [1, 2, 3, 4, 5]
    assert float(found.blocks[-1].keys[0][0, -1, 0]) == 5.0  # a partial block, cut at the token
    assert recent.longest([7, 7], "t") is None


def test_namespaces_never_meet() -> None:
    recent = RecentPrefixes(1 << 20)
    recent.add(cache_of([1, 2, 3, 4, 5]), "tenant-a")
    assert recent.longest([1, 2, 3, 4, 5], "tenant-b") is None
    assert recent.longest([1, 2, 3, 4, 5], "tenant-a") is not None


def test_the_budget_drops_the_least_recently_used_and_an_extension_replaces_its_prefix() -> None:
    one = cache_of([1] * 8).nbytes
    recent = RecentPrefixes(2 * one)
    recent.add(cache_of([1] * 8), "t")
    recent.add(cache_of([2] * 8), "t")
    assert recent.longest([1] * 8, "t") is not None  # now the most recent
    recent.add(cache_of([3] * 8), "t")
    assert recent.longest([2] * 8, "t") is None and recent.longest([1] * 8, "t") is not None
    roomy = RecentPrefixes(1 << 20)
    roomy.add(cache_of([1] * 8), "t")
    roomy.add(cache_of([1] * 12), "t")  # extends [1]*8: the shorter entry goes
    assert len(roomy) == 1 and roomy.nbytes == cache_of([1] * 12).nbytes


def test_an_identical_prompt_without_an_agent_reuses_all_but_its_last_token() -> None:
    h = Harness(prefix_cache_mb=0)  # no store reuse: the worker's own memory, token by token
    chat = {"messages": [{"role": "user", "content": "the very same question"}], "max_tokens": 3}
    first = h.producer.submit(chat)
    h.run_until(h.all_ended([first]))
    again = h.producer.submit(chat)
    h.run_until(h.all_ended([again]))
    usage = again.result().usage
    assert first.result().usage.reused_tokens == 0
    assert usage.reused_tokens == usage.prompt_tokens - 1


def test_recent_prefixes_off_reuses_nothing() -> None:
    h = Harness(prefix_cache_mb=0, recent_prefix_mb=0)
    chat = {"messages": [{"role": "user", "content": "the very same question"}], "max_tokens": 3}
    handles = [h.producer.submit(chat), h.producer.submit(chat)]
    h.run_until(h.all_ended(handles))
    assert [handle.result().usage.reused_tokens for handle in handles] == [0, 0]
