"""A store that fails, under the worker loop (fakeredis harness, fake engine): the answer never depends
on the store. Each failure costs the job its warm start at most: it finishes by a full prefill, the
failure is logged and counted, and the worker goes on with the next job.

The real-process version (a store on a full tmpfs) is in test_integration_outages.py.
"""

from __future__ import annotations

import errno
from concurrent.futures import Future
from typing import Any

import pytest

from engine.core.blocks import AgentCache
from engine.core.errors import CacheMismatchError
from producer.client import JobHandle
from producer.wire.protocol import agent_lock_key
from store.errors import StoreError
from tests.worker.fakes import SPEC, DictStore, FakeEngine
from tests.worker.harness import Harness

DISK_FULL = OSError(errno.ENOSPC, "No space left on device")


class FailingStore(DictStore):
    """A DictStore whose reads or writes fail in one chosen way; a failed put stores nothing."""

    def __init__(
        self,
        *,
        prefetch_raises: bool = False,
        prefetch_fails: bool = False,
        put_raises: bool = False,
        put_fails: bool = False,
    ) -> None:
        super().__init__()
        self.prefetch_raises = prefetch_raises
        self.prefetch_fails = prefetch_fails
        self.put_raises = put_raises
        self.put_fails = put_fails

    def read(self, agent_id: str) -> Future[AgentCache | None]:
        if self.prefetch_raises:
            raise StoreError("prefetch on a closed store")
        if self.prefetch_fails:
            failed: Future[AgentCache | None] = Future()
            failed.set_exception(OSError(errno.EIO, "Input/output error"))
            return failed
        return super().read(agent_id)

    def put(
        self, agent_id: str, cache: AgentCache, *, fence: int | None = None, namespace: str | None = None
    ) -> Future[bool]:
        self.puts.append(agent_id)
        if self.put_raises:
            raise DISK_FULL
        if self.put_fails:
            failed: Future[bool] = Future()
            failed.set_exception(DISK_FULL)
            return failed
        return super().put(agent_id, cache, fence=fence)


class OtherModelEngine(FakeEngine):
    """Refuses every saved cache the way the real engine refuses a cache of another model."""

    def submit(self, *args: Any, **kwargs: Any) -> int:
        if kwargs.get("cache") is not None:
            raise CacheMismatchError("the cache was made by model 'other', this engine runs 'fake'")
        return super().submit(*args, **kwargs)


PROMPT = "hello there"


def harness_with(store: DictStore, engine: FakeEngine | None = None) -> Harness:
    h = Harness()
    h.store = store
    if engine is not None:
        h.engine = engine
    h.loop = h.new_loop()
    return h


def saved_cache(tokens: int) -> AgentCache:
    """A cache the agent's earlier turn left: the first `tokens` tokens of PROMPT."""
    return AgentCache(SPEC, [ord(c) for c in PROMPT[:tokens]], [])


def run_turn(h: Harness, prompt: str = PROMPT, agent: str = "A") -> JobHandle:
    handle = h.producer.submit({"agent_id": agent, "prompt": prompt, "max_tokens": 3})
    h.run_until(h.all_ended([handle]))  # each iteration is a run_once: it raises if the loop breaks
    return handle


def assert_prefilled(handle: JobHandle) -> None:
    result = handle.result(timeout=1)
    assert result.text == "abc"
    assert result.usage.reused_tokens == 0
    assert result.usage.prefilled_tokens == result.usage.prompt_tokens == len(PROMPT)


def assert_worker_goes_on(h: Harness) -> None:
    """The same loop answers a job of another agent afterwards."""
    later = run_turn(h, "next please", agent="B")
    assert later.result(timeout=1).text == "abc"


def test_a_cache_read_whose_future_fails_costs_only_the_warm_start() -> None:
    h = harness_with(FailingStore(prefetch_fails=True))
    h.store.caches["A"] = saved_cache(8)
    handle = run_turn(h)
    assert h.store.prefetches == ["A"]
    assert_prefilled(handle)
    assert h.loop.counts["cache_read_failed"] == 1
    assert_worker_goes_on(h)


def test_a_cache_read_that_raises_at_once_costs_only_the_warm_start() -> None:
    h = harness_with(FailingStore(prefetch_raises=True))
    h.store.caches["A"] = saved_cache(8)
    handle = run_turn(h)
    assert_prefilled(handle)
    assert h.loop.counts["cache_read_failed"] == 1
    assert_worker_goes_on(h)


def test_a_cache_of_another_model_is_prefilled_over() -> None:
    h = harness_with(DictStore(), OtherModelEngine())
    h.store.caches["A"] = saved_cache(8)
    handle = run_turn(h)
    assert_prefilled(handle)
    assert h.store.puts == ["A"]  # the new turn's cache replaces the unusable one
    assert h.loop.counts["cache_read_failed"] == 1
    assert_worker_goes_on(h)


def test_a_put_that_raises_is_counted_and_frees_the_agent() -> None:
    h = harness_with(FailingStore(put_raises=True))
    first = run_turn(h)
    assert first.result(timeout=1).text == "abc"
    assert h.loop.counts["cache_put_failed"] == 1
    assert h.loop.counts["finished"] == 1
    assert not h.redis.exists(agent_lock_key("A"))  # the agent's next job is not held up
    second = run_turn(h, PROMPT + "abc more")
    assert second.result(timeout=1).usage.reused_tokens == 0  # nothing was saved to resume from
    assert h.loop.counts["cache_put_failed"] == 2
    assert_worker_goes_on(h)


def test_a_put_whose_future_fails_with_a_full_disk_is_counted_and_frees_the_agent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    h = harness_with(FailingStore(put_fails=True))
    first = run_turn(h)
    assert first.result(timeout=1).text == "abc"
    h.loop.run_once()  # the loop polls the put's future
    assert h.loop.counts["cache_put_failed"] == 1
    assert not h.redis.exists(agent_lock_key("A"))
    assert "No space left on device" in caplog.text
    second = run_turn(h, PROMPT + "abc more")
    assert second.result(timeout=1).usage.reused_tokens == 0
    assert_worker_goes_on(h)
