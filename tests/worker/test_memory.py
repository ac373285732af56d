from __future__ import annotations

import json
import subprocess
import sys

import pytest

from worker.fleet.memory import MiB, memory_field

TOUCH = """
import numpy as np
from worker.fleet.memory import MiB, resident_bytes
before = resident_bytes()
block = np.ones(64 * MiB, dtype=np.uint8)  # touched: resident
print((resident_bytes() - before) / MiB)
"""


def test_resident_bytes_follows_memory_the_process_touches() -> None:
    # A fresh interpreter: in the test process, memory earlier tests freed (and the
    # allocator kept resident) can serve the block without the RSS moving.
    run = subprocess.run([sys.executable, "-c", TOUCH], capture_output=True, text=True, check=True)
    assert float(run.stdout) >= 48


def test_memory_field_is_mb_by_kind_with_the_store_figures() -> None:
    engine = {"mlx_active": 900 * MiB, "slab_idle": 12 * MiB}
    store = {"hot_bytes": 64 * MiB, "pending_bytes": 3 * MiB // 2, "hits": 7}
    figures = json.loads(memory_field(engine, store))
    assert figures.pop("rss") > 10
    assert figures == {"mlx_active": 900.0, "slab_idle": 12.0, "hot_tier": 64.0, "pending_writes": 1.5}


FRAGMENTS = """
import sys
import numpy as np
from worker.fleet.memory import MiB, resident_bytes, return_large_frees_to_the_os
if sys.argv[1] == "fixed":
    assert return_large_frees_to_the_os()
x = np.ones(8 * MiB, np.uint8)
del x  # a freed mapping: glibc raises its mmap threshold to 8 MB unless it is fixed
before = resident_bytes()
arrays, pins = [], []
for _ in range(32):
    arrays.append(np.ones(4 * MiB, np.uint8))  # a cache read into a fresh array
    pins.append(bytearray(4096))  # small, long-lived: pins the heap between the arrays
del arrays
print((resident_bytes() - before) / MiB)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator only")
def test_freed_cache_arrays_go_back_to_the_os_despite_long_lived_objects_between_them() -> None:
    def grown_mb(mode: str) -> float:
        run = subprocess.run(
            [sys.executable, "-c", FRAGMENTS, mode], capture_output=True, text=True, check=True
        )
        return float(run.stdout)

    assert grown_mb("fixed") < 16
    assert grown_mb("glibc-default") > 64  # what a worker did without it: 128 MB kept
