from __future__ import annotations

import json

import numpy as np

from worker.memory import MiB, memory_field, resident_bytes


def test_resident_bytes_follows_memory_the_process_touches() -> None:
    before = resident_bytes()
    block = np.ones(64 * MiB, dtype=np.uint8)  # touched: resident
    assert resident_bytes() - before >= 48 * MiB
    del block


def test_memory_field_is_mb_by_kind_with_the_store_figures() -> None:
    engine = {"mlx_active": 900 * MiB, "slab_idle": 12 * MiB}
    store = {"hot_bytes": 64 * MiB, "pending_bytes": 3 * MiB // 2, "hits": 7}
    figures = json.loads(memory_field(engine, store))
    assert figures.pop("rss") > 10
    assert figures == {"mlx_active": 900.0, "slab_idle": 12.0, "hot_tier": 64.0, "pending_writes": 1.5}
