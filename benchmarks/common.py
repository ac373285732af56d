"""What every benchmark script shares: the repo on sys.path, percentiles, the machine note, the JSON out.

Scripts run as `python benchmarks/bench_x.py` from anywhere; importing this module first (the
script's own folder is on sys.path) puts the repo root there too, so `engine`, `store`, `worker`,
`producer` and `benchmarks.procs` import. Nothing here imports from tests/.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, overload

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
NAN = float("nan")  # a percentile of no values where a number must follow
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@overload
def percentile(values: Sequence[float], q: float) -> float | None: ...
@overload
def percentile(values: Sequence[float], q: float, empty: float) -> float: ...
def percentile(values: Sequence[float], q: float, empty: float | None = None) -> float | None:
    """The nearest-rank q-quantile (0 <= q <= 1) of `values`; `empty` (None) for none."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else empty


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """`rows` as a markdown table: `columns` (default: the first row's keys) in order, "" where absent."""
    keys = list(columns if columns is not None else rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(row.get(key, "")) for key in keys) + " |" for row in rows]
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    """Where a result was measured: the machines are shared, so the load average goes with every run."""
    return {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "commit": git_commit(),
        "load_average": os.getloadavg(),
    }


def git_commit() -> str:
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
    except OSError:
        return "unknown"
    return done.stdout.strip() or "unknown"


def write_json(out: Path | str, report: Any) -> Path:
    """Write a run's report (benchmarks/results/ is git-ignored: the latest tables live in the README)."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds (a server that hangs)."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
