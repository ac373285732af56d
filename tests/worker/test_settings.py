"""Configuration: env vars and flags, the documented table, and which commands import MLX."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import typing
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


def _documented_settings() -> dict[str, dict[str, str]]:
    """docs/worker.md's configuration table: setting -> its env, flag and default cells."""
    rows = {}
    for line in (ROOT / "docs" / "worker.md").read_text().splitlines():
        if re.match(r"^\| \w+ \| `KVRQ_", line):
            name, env, flag, default, _meaning = (cell.strip() for cell in line.split("|")[1:-1])
            rows[name] = {"env": env.strip("`"), "flag": _flag(flag), "default": default}
    return rows


def _flag(cell: str) -> str:
    """ "`--queue` (repeat)" -> "--queue"; "" for settings without a flag."""
    found = re.match(r"`(--[\w-]+)`", cell)
    return found.group(1) if found else ""


def _shown(value: object) -> str:
    """A default as the table and `--help` show it: `5` for 5.0, `100000` for 100_000."""
    return f"{value:g}" if isinstance(value, float) else str(value)


# Settings whose default is None, and what the table says instead (each checked against the code below).
NONE_DEFAULTS_AS_DOCUMENTED = {
    "store_max_mb": "unbounded",
    "prefix_cache_mb": "a quarter of `store_max_mb`, else 1024",
    "pool_mb": "`2048` (engine)",
    "pool_blocks": "",
    "kv_bits": "",
    "draft_model": "",
    "kv_group_size": "`64` (engine)",
    "name": "`kvrq.HOST.PID.xxxx`",
    "max_held": "`2 x max_batch`",
    "metrics_port": "off",
}


def test_every_setting_is_in_the_documented_table() -> None:
    rows = _documented_settings()
    assert set(rows) == set(WorkerSettings.model_fields)
    assert {name: row["env"] for name, row in rows.items()} == {name: f"KVRQ_{name.upper()}" for name in rows}


def test_documented_defaults_are_the_real_ones() -> None:
    rows = _documented_settings()
    for name, field in WorkerSettings.model_fields.items():
        if field.default is None:
            assert rows[name]["default"] == NONE_DEFAULTS_AS_DOCUMENTED[name], name
        else:
            assert rows[name]["default"] == f"`{_shown(field.default)}`", name


def test_what_none_defaults_stand_for() -> None:
    import socket

    from engine.batch.engine import DEFAULT_POOL_MB
    from worker.jobs.rqexec import default_worker_name

    settings = WorkerSettings()
    assert f"`{DEFAULT_POOL_MB}` (engine)" == NONE_DEFAULTS_AS_DOCUMENTED["pool_mb"]
    from engine.kv.quant import DEFAULT_GROUP_SIZE

    assert f"`{DEFAULT_GROUP_SIZE}` (engine)" == NONE_DEFAULTS_AS_DOCUMENTED["kv_group_size"]
    assert settings.held_limit == 2 * settings.max_batch
    host, pid = re.escape(socket.gethostname()), os.getpid()
    assert re.fullmatch(rf"kvrq\.{host}\.{pid}\.[0-9a-f]{{4}}", default_worker_name())


def _worker_flags() -> dict[str, argparse.Action]:
    """`kvrq worker`'s options (without --help), by option string."""
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    worker = commands.choices["worker"]
    return {
        option: action
        for action in worker._actions
        if not isinstance(action, argparse._HelpAction)
        for option in action.option_strings
    }


def _sample_value(name: str) -> tuple[str, object]:
    """A valid non-default value for the setting: (as typed on the command line, as parsed)."""
    annotation = WorkerSettings.model_fields[name].annotation
    optional = [a for a in typing.get_args(annotation) if typing.get_origin(a) is typing.Literal]
    annotation = optional[0] if optional else annotation  # Literal[...] | None: one of the literals
    choices = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Literal:
        return str(choices[-1]), choices[-1]
    kinds = set(choices) or {annotation}
    if int in kinds:
        return "7", 7
    if float in kinds:
        return "2.5", 2.5
    return "custom", "custom"


def test_documented_flags_exist_and_set_their_setting() -> None:
    documented = {row["flag"]: name for name, row in _documented_settings().items() if row["flag"]}
    assert set(documented) == set(_worker_flags()), "docs/worker.md's flags and `kvrq worker --help` differ"
    for flag, name in documented.items():
        typed, parsed = _sample_value(name)
        settings = worker_settings(build_parser().parse_args(["worker", flag, typed]))
        assert getattr(settings, name) == parsed, f"{flag} does not set {name}"


def test_help_shows_the_documented_defaults() -> None:
    documented = {row["flag"]: row["default"] for row in _documented_settings().values() if row["flag"]}
    for flag, action in _worker_flags().items():
        shown = re.search(r"\[([^\]]+)\]$", action.help or "")
        if shown is not None:
            assert f"`{shown.group(1)}`" == documented[flag].removesuffix(" (engine)"), flag


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
    loaded = _imports_after("import producer.client, producer.models, producer.wire.protocol")
    assert not loaded & {"mlx", "mlx_lm", "numpy", "engine", "store", "worker", "transformers"}


def test_http_server_is_a_producer() -> None:
    """`kvrq serve` (producer/http) imports no MLX and nothing of the worker side."""
    loaded = _imports_after("import producer.http.app")
    assert not loaded & {"mlx", "mlx_lm", "numpy", "engine", "store", "worker", "transformers"}
    loaded = _imports_after("import worker.cli.serve_http, producer.http.app")
    assert not loaded & {"mlx", "mlx_lm", "numpy", "engine", "store", "transformers"}


def test_client_commands_do_not_import_mlx() -> None:
    loaded = _imports_after(
        "from worker.cli import build_parser; build_parser()\n"
        "import worker.cli.commands, worker.cli.demo, worker.fleet.maintenance, worker.cli.spawn"
    )
    assert not loaded & {"mlx", "mlx_lm", "numpy", "engine", "transformers"}
