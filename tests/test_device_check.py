"""benchmarks/device_check.sh, the GPU check, works before a GPU is there: it parses, its dry run
lists every stage with the backend's mlx, and its CPU mode runs its setup and device stages for
real (reusing this venv) and prints the table."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "device_check.sh"
STAGES = ["setup", "device", "parity-resume", "throughput", "speculation", "agents-restart"]


def run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
        cwd=ROOT,
    )


def table_rows(stdout: str) -> dict[str, list[str]]:
    rows = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) == 4 and cells[0] in STAGES:
            rows[cells[0]] = cells[1:]
    return rows


def test_the_script_parses() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


def test_the_dry_run_lists_every_stage_with_the_backends_mlx(tmp_path: Path) -> None:
    for args, mlx in ((("--dry-run",), "mlx[cuda]"), (("--dry-run", "--cpu"), "mlx[cpu]")):
        done = run(*args, KVRQ_DEVICE_CHECK_OUT=str(tmp_path))
        assert done.returncode == 0, done.stderr
        rows = table_rows(done.stdout)
        assert list(rows) == STAGES
        assert mlx in rows["setup"][2]
        assert "-m mlx_path" in rows["parity-resume"][2] and "bench_spec.py" in rows["speculation"][2]


def test_the_cpu_mode_runs_its_stages_and_prints_the_table(tmp_path: Path) -> None:
    venv = Path(sys.executable).parent.parent  # this venv has the worker, pytest and the model
    done = run(
        "--cpu", "--venv", str(venv), KVRQ_DEVICE_CHECK_OUT=str(tmp_path), KVRQ_DEVICE_CHECK_STAGES="device"
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = table_rows(done.stdout)
    assert rows["setup"][0] == "ok" and rows["setup"][2] == f"reusing {venv}"
    assert rows["device"][0] == "ok" and "cpu" in rows["device"][2]
    assert all(rows[name][0] == "skipped: not selected" for name in STAGES[2:5])
    assert (tmp_path / "device.log").exists()
