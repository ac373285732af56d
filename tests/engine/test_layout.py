"""engine/'s folders mean what they say: core imports no MLX, and no module imports its way back to itself."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "engine"


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ENGINE.parent).with_suffix("").parts).removesuffix(".__init__")


def engine_imports() -> dict[str, set[str]]:
    """Each engine module's engine imports, wherever they stand in the file (functions included)."""
    modules = {module_name(path): path for path in ENGINE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("engine"):
                module = node.module or ""
                found |= {f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in modules}
                found.add(module)
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name in modules}
        graph[name] = found & set(modules) - {name}
    return graph


def test_no_engine_module_imports_its_way_back_to_itself() -> None:
    graph = engine_imports()
    cycles = []
    for start in graph:
        stack, seen = [(start, [start])], set()
        while stack:
            module, path = stack.pop()
            for child in graph[module]:
                if child == start:
                    cycles.append(" -> ".join([*path, child]))
                elif child not in seen:
                    seen.add(child)
                    stack.append((child, [*path, child]))
    assert cycles == []


def test_core_imports_without_mlx() -> None:
    """The store and the worker's scheduling import engine.core: a machine without MLX can."""
    core = sorted(module_name(p) for p in (ENGINE / "core").glob("*.py"))
    code = (
        f"import sys; [__import__(m) for m in {core!r}]; import engine.cpu.blas; print('mlx' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
