"""Pick the fast BLAS on Linux automatically.

mlx-cpu's wheel bundles a reference BLAS; Debian's OpenBLAS is 10-60x faster for the
matmuls a model runs. It must be preloaded before the process starts, so CLI entry
points re-exec themselves once with LD_PRELOAD set. KVRQ_OPENBLAS=0 opts out (the older
KVRQ_NO_OPENBLAS=1 still does). Pure Python: no mlx import here.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from engine.core.switches import switch

OPENBLAS_CANDIDATES = (
    "/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
)
SWITCH = "KVRQ_OPENBLAS"
LEGACY_OPT_OUT = "KVRQ_NO_OPENBLAS"
_REEXEC_MARK = "KVRQ_BLAS_REEXEC"


def find_openblas() -> str | None:
    for candidate in OPENBLAS_CANDIDATES:
        if Path(candidate).exists():
            return candidate
    return None


def blas_preload_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: os.environ) with OpenBLAS added to LD_PRELOAD where it helps."""
    env = dict(os.environ if env is None else env)
    if not sys.platform.startswith("linux") or not wanted(env):
        return env
    library = find_openblas()
    if library is None or library in env.get("LD_PRELOAD", ""):
        return env
    env["LD_PRELOAD"] = ":".join(p for p in (library, env.get("LD_PRELOAD", "")) if p)
    return env


def wanted(env: Mapping[str, str] | None = None) -> bool:
    """Whether the user lets kvrq preload OpenBLAS (KVRQ_OPENBLAS, default on)."""
    return switch(SWITCH, environ=env) and not switch(LEGACY_OPT_OUT, default=False, environ=env)


def ensure_fast_blas(argv: Sequence[str] | None = None) -> None:
    """Re-exec this process once with OpenBLAS preloaded, when on Linux and available.

    Does nothing on macOS (Metal), when KVRQ_OPENBLAS=0, when OpenBLAS is not
    installed (apt-get install libopenblas0-pthread) or when it is already preloaded.
    """
    if os.environ.get(_REEXEC_MARK):
        return
    env = blas_preload_env()
    if env.get("LD_PRELOAD") == os.environ.get("LD_PRELOAD"):
        return
    env[_REEXEC_MARK] = "1"
    args = list(sys.argv if argv is None else argv)
    os.execve(sys.executable, [sys.executable, *_interpreter_args(args)], env)


def _interpreter_args(argv: list[str]) -> list[str]:
    """Arguments that rerun the same program: a script path, or `-m module` for console scripts."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        module = spec.name.removesuffix(".__main__")
        return ["-m", module, *argv[1:]]
    return argv


def openblas_loaded() -> bool:
    """True when OpenBLAS is mapped into this process (Linux only)."""
    try:
        return "libopenblas" in Path("/proc/self/maps").read_text()
    except OSError:
        return False
