"""Where a worker's memory goes, in MB: published in its rq worker hash (`kvrq status`, the soak).

The figures let an operator check a worker against its stated bound (docs/worker.md,
"Memory"): the process's resident set next to what the engine and the store say they
hold, so growth that none of them accounts for shows as a gap instead of a guess.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import resource
import sys
from collections.abc import Mapping

MiB = 1024 * 1024
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


def return_large_frees_to_the_os(threshold_bytes: int = MiB) -> bool:
    """Serve allocations of `threshold_bytes` or more with their own mappings, for good (glibc).

    glibc raises its mmap threshold (up to 32 MB) each time a mapped block is freed, so a
    long-lived process that reads caches into fresh multi-MB arrays on several threads ends
    up placing them in heap arenas whose freed holes it keeps: a soak of 300 agent turns
    grew 340 MB this way while everything the worker accounts for stayed flat. A fixed
    threshold turns that off. False where there is no glibc (macOS: nothing to do).
    """
    name = ctypes.util.find_library("c")
    if not sys.platform.startswith("linux") or name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold_bytes))


def resident_bytes() -> int:
    """The process's resident set now (Linux); elsewhere its peak, the best the OS offers cheaply."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB


def memory_field(engine_bytes: Mapping[str, int], store_stats: Mapping[str, int]) -> str:
    """JSON of MB by kind: rss, the engine's (BlockPoolBatchEngine.memory), hot tier, pending writes."""
    figures = {"rss": resident_bytes(), **engine_bytes}
    figures["hot_tier"] = store_stats.get("hot_bytes", 0)
    figures["pending_writes"] = store_stats.get("pending_bytes", 0)
    return json.dumps({kind: round(n / MiB, 1) for kind, n in figures.items()}, sort_keys=True)
