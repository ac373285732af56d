"""The layers' import rules: the wire contract at the bottom, the store beside the clients.

`producer.wire` imports nothing of kvrq outside itself; `store/` imports nothing of the producer but
the wire; and importing the wire pulls in neither rq nor pydantic (a store-only process needs neither).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIRST_PARTY = ("engine", "store", "worker", "producer")


def _imports(folder: str) -> list[tuple[str, str]]:
    """(file, module) for every first-party import under `folder`, in functions too."""
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            found += [(str(path.relative_to(ROOT)), n) for n in names if n.split(".")[0] in FIRST_PARTY]
    return found


def test_the_wire_imports_only_itself() -> None:
    outside = [(f, m) for f, m in _imports("producer/wire") if not m.startswith("producer.wire")]
    assert outside == []


def test_the_store_imports_of_the_producer_only_the_wire() -> None:
    outside = [
        (f, m) for f, m in _imports("store") if m.startswith("producer") and not m.startswith("producer.wire")
    ]
    assert outside == []


def test_the_wire_loads_without_rq_or_pydantic() -> None:
    code = (
        "import sys, producer.wire.protocol, producer.wire.redis_url, producer.wire.ids, "
        "producer.wire.redact, producer.wire.text; "
        "print(sorted(m for m in ('rq', 'pydantic') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_benchmarks_import_nothing_from_tests_but_the_client_sessions() -> None:
    """What benchmarks and tests share lives in benchmarks/ (procs, caches, sentinel, chaos_checks,
    tiny_models) and the tests import it; bench_clients.py alone drives tests/clients' own drivers."""
    found = []
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            found += [(path.name, n) for n in names if n.split(".")[0] == "tests"]
    assert [(f, m) for f, m in found if f != "bench_clients.py"] == []
