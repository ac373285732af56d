"""Where a worker's memory goes, in MB: published in its rq worker hash (`kvrq status`, the soak).

The figures let an operator check a worker against its stated bound (docs/worker.md,
"Memory"): the process's resident set next to what the engine and the store say they
hold, so growth that none of them accounts for shows as a gap instead of a guess.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from collections.abc import Mapping

MiB = 1024 * 1024


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
