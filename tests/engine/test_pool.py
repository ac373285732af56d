from __future__ import annotations

import pytest

from engine.core.blocks import BlockPool
from engine.core.errors import PoolExhaustedError, RequestTooLargeError
from engine.core.spec import LayerSpec, ModelCacheSpec


def test_allocate_and_free_counts() -> None:
    pool = BlockPool(10)
    pool.allocate("a", 3)
    pool.allocate("b", 4)
    pool.allocate("a", 1)
    assert (pool.used_blocks, pool.free_blocks, pool.held_by("a"), pool.held_by("b")) == (8, 2, 4, 4)
    assert pool.free("a") == 4
    assert (pool.used_blocks, pool.free_blocks) == (4, 6)
    assert pool.free("a") == 0


def test_exhausted_says_what_was_asked_and_changes_nothing() -> None:
    pool = BlockPool(5)
    pool.allocate("a", 4)
    with pytest.raises(PoolExhaustedError, match="requested 3 blocks, 1 of 5 free") as info:
        pool.allocate("b", 3)
    assert (info.value.requested, info.value.free, info.value.total) == (3, 1, 5)
    assert pool.free_blocks == 1 and pool.held_by("b") == 0


def test_larger_than_whole_pool_is_its_own_error() -> None:
    pool = BlockPool(5)
    with pytest.raises(RequestTooLargeError, match="needs 6 blocks but the whole pool holds 5"):
        pool.allocate("a", 6)
    assert not issubclass(RequestTooLargeError, PoolExhaustedError)


def test_budget_in_megabytes_uses_the_spec() -> None:
    spec = ModelCacheSpec("m", 30, (LayerSpec("full"),) * 30, 3, 64, 64, "float32")
    pool = BlockPool.from_megabytes(100, spec)
    assert pool.total_blocks == 100 * 1024 * 1024 // spec.bytes_per_block()
    with pytest.raises(ValueError, match="holds no block"):
        BlockPool.from_megabytes(1, spec)


def test_rename_moves_ownership() -> None:
    pool = BlockPool(4)
    pool.allocate("tmp", 2)
    pool.rename("tmp", 7)
    assert pool.held_by(7) == 2 and pool.held_by("tmp") == 0
    pool.free(7)
    assert pool.free_blocks == 4
