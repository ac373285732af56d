"""Configuration: env vars and flags, the documented table, and which commands import MLX."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from worker.cli.main import build_parser, worker_settings
from worker.settings import WorkerSettings

ROOT = Path(__file__).resolve().parents[2]


def test_flags_override_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVRQ_MAX_BATCH", "4")
    monkeypatch.setenv("KVRQ_QUEUES", "a,b")
    monkeypatch.setenv("KVRQ_HEARTBEAT_TTL", "12")
    parser = build_parser()
    from_env = worker_settings(parser.parse_args(["worker"]))
    assert (from_env.max_batch, from_env.queue_names, from_env.heartbeat_ttl) == (4, ["a", "b"], 12)
    flagged = worker_settings(
        parser.parse_args(["worker", "--max-batch", "8", "--queue", "x", "--queue", "y"])
    )
    assert (flagged.max_batch, flagged.queue_names) == (8, ["x", "y"])
    assert flagged.held_limit == 16


def test_store_redis_means_the_queues_redis() -> None:
    settings = WorkerSettings(redis_url="redis://10.0.0.1:6380/2", store="redis")
    assert settings.store_uri() == "redis://10.0.0.1:6380/2"
    assert WorkerSettings(store="disk:/tmp/x").store_uri() == "disk:/tmp/x"


def test_every_setting_is_in_the_documented_table() -> None:
    doc = (ROOT / "docs" / "worker.md").read_text()
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| (\w+) \| `(KVRQ_\w+)` \|", doc, re.M)}
    assert set(rows) == set(WorkerSettings.model_fields)
    assert all(env == f"KVRQ_{name.upper()}" for name, env in rows.items())


def _imports_after(code: str) -> set[str]:
    done = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys; print(' '.join(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    )
    return {name.split(".")[0] for name in done.stdout.split()}


def test_producer_needs_only_redis_rq_and_pydantic() -> None:
    loaded = _imports_after("import producer.client, producer.models, producer.protocol")
    assert not loaded & {"mlx", "mlx_lm", "numpy", "engine", "store", "worker", "transformers"}


def test_client_commands_do_not_import_mlx() -> None:
    loaded = _imports_after(
        "from worker.cli import build_parser; build_parser()\n"
        "import worker.cli.commands, worker.cli.demo, worker.maintenance, worker.cli.spawn"
    )
    assert not loaded & {"mlx", "mlx_lm", "numpy", "engine", "transformers"}
