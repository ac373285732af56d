"""The optional CPU acceleration (engine/cpu), found by name: a checkout or build without it
(deleted, or left out) runs on MLX's own ops instead of failing to import.

Pure Python: the worker's CLI asks for `blas` here before MLX is loaded (it re-execs with
OpenBLAS preloaded); the batching loop asks for `door` (engine/batch/acceleration.py).
"""

from __future__ import annotations

import importlib
from types import ModuleType


def cpu_module(name: str) -> ModuleType | None:
    """engine.cpu.`name`, or None where engine/cpu is not installed. Any other missing module
    (a dependency of engine/cpu) is still an error."""
    module = f"engine.cpu.{name}"
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as missing:
        if missing.name not in ("engine.cpu", module):
            raise
        return None
