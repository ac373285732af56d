"""Decoding rows' attention in one C call per layer, and the softmax of the other rows' scores,
on the CPU (engine/cpu/native/decode_attention.c, softmax_rows.c).

Why: a decoding row with its own K/V buffers costs MLX ~10 small ops a layer (~8 us each to run
on the 2-core dev machine) and matmuls of 3 query rows that read K/V at ~3.5 GB/s: twelve agents
of ~760 tokens spent about a third of each decode step there. The C loop reads each K/V line once,
on two threads, for every decoding row of the layer in one call: whole decode steps of 12 such
rows ran 1.28x faster (1.51x at 4K tokens), 16 slotted rows of 300 tokens 1.18x
(`python benchmarks/bench_attention.py --only decode`; benchmarks/README.md). The rows MLX's
matmuls serve (a prefill chunk, a warm agent's suffix) get their softmax here too: numpy's
max, subtract, exp and sum are four passes over the scores, the C loop's two, on two threads.

The library is compiled when the engine starts (`library()`, called by engine/batch/
acceleration.py's `prepare`, never inside a step: a step only takes what `loaded()` returns) with
the system's C compiler ($CC, else cc) into a cache folder keyed by the source, the compiler, the
flags and the CPU ($KVRQ_NATIVE_CACHE, else $XDG_CACHE_HOME/kvrq/native, else ~/.cache/kvrq/native)
and loaded with ctypes: no build step at install; the sources ship as package data. A library is
loaded only from a folder (and file) this user owns and no one else can write: another user who
could write there could make this process run their code. Without the sources, a compiler or a
cache folder it may use, or if compiling fails, `library()` is None (one warning saying why) and
attention stays on MLX's path (the softmax on numpy's).

Guarantees: only float32 rows of one query token that attend all their keys, or a known prefix
of them (`prefix_lengths`, the ShortSlots' rows), key dims a multiple of 8; the softmax only for
float32 scores in one piece, causal or unmasked; the same attention up to float32 rounding (max
difference ~6e-7 on unit-scale inputs, ~2e-6 relative for the softmax's sums over 8K keys; greedy
tokens equal mlx_lm.generate's in the parity tests); KVRQ_NATIVE_ATTENTION=0 turns both off
(engine/cpu/shortcuts.py); KVRQ_ATTENTION_THREADS sets the threads (default: up to 2).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

from engine.batch.attention import AttentionCall, QuantizedCall
from engine.cpu.shortcuts import current

log = logging.getLogger(__name__)

NATIVE = Path(__file__).parent / "native"
SOURCES = (NATIVE / "decode_attention.c", NATIVE / "decode_attention_quantized.c", NATIVE / "softmax_rows.c")
HEADERS = (NATIVE / "vector_math.h", NATIVE / "spans.h")
LANES = 8  # the C loops' vector width: head dims must be multiples of it
MAX_REPEATS = 64  # query heads per KV head the C loop holds
# -fno-math-errno -fno-trapping-math change no value; without them gcc leaves the softmax's
# exp and max loops scalar (3x slower than numpy instead of 3x faster).
FLAGS = (
    f"-DKVRQ_LANES={LANES}",  # the C code takes its limits from here: one place states them
    f"-DKVRQ_MAX_REPEATS={MAX_REPEATS}",
    "-O3",
    "-march=native",
    "-std=c11",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-shared",
    "-fPIC",
    "-pthread",
)
# Below this many K/V lines in a layer, a second thread costs more than it saves.
THREAD_MIN_LINES = 2048
# Below this many scores in a layer, the softmax stays on one thread.
SOFTMAX_THREAD_MIN_SCORES = 65536
_POINTER = ctypes.c_void_p


def cache_dir() -> Path:
    configured = os.environ.get("KVRQ_NATIVE_CACHE")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvrq" / "native"


class NativeUnavailable(Exception):
    """Why the C library cannot be used here (the warning's text)."""


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernel, built once per source, compiler, flags and CPU and loaded; None where
    it cannot be (one warning saying why). Builds: call it at start, not inside a step."""
    try:
        lib = _build_and_load()
    except NativeUnavailable as why:
        log.warning("C attention unavailable (%s): attention stays on MLX's and numpy's path", why)
        return None
    lib.decode_attention.argtypes = [ctypes.c_int, *[_POINTER] * 6, *[ctypes.c_int] * 4, ctypes.c_float]
    lib.decode_attention.argtypes += [_POINTER, ctypes.c_int]
    lib.decode_attention.restype = ctypes.c_int
    lib.decode_attention_quantized.argtypes = [ctypes.c_int, *[_POINTER] * 12, *[ctypes.c_int] * 6]
    lib.decode_attention_quantized.argtypes += [ctypes.c_float, _POINTER, ctypes.c_int]
    lib.decode_attention_quantized.restype = ctypes.c_int
    lib.dequantize_heads.argtypes = [
        *[_POINTER] * 3,
        ctypes.c_int,
        *[ctypes.c_int64] * 3,
        *[ctypes.c_int] * 3,
    ]
    lib.dequantize_heads.argtypes += [_POINTER]
    lib.dequantize_heads.restype = ctypes.c_int
    lib.softmax_rows.argtypes = [_POINTER, *[ctypes.c_int64] * 3, _POINTER, ctypes.c_int]
    lib.softmax_rows.restype = ctypes.c_int
    return lib


def loaded() -> ctypes.CDLL | None:
    """The library if `library()` already ran (built or not); never builds (a step's call)."""
    return library() if library.cache_info().currsize else None


def _build_and_load() -> ctypes.CDLL:
    compiler = _compiler()
    if compiler is None:
        raise NativeUnavailable("no C compiler found: set CC or install gcc")
    try:
        source = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    except OSError as exc:
        raise NativeUnavailable(f"the C sources are not installed ({exc})") from None
    built_for = " ".join((compiler, *FLAGS, platform.machine(), _cpu_features()))
    key = hashlib.sha256(source + built_for.encode()).hexdigest()[:16]
    folder = cache_dir()
    target = folder / f"attention-{key}.so"
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        _check_private(folder)
        if not target.exists():
            _compile(compiler, target)
        _check_private(target)
        try:
            return ctypes.CDLL(str(target))
        except OSError:  # a damaged file in the cache (a full disk, say): built again, once
            target.unlink(missing_ok=True)
            _compile(compiler, target)
            return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeUnavailable(f"could not build into {folder}: {exc}") from None


def _check_private(path: Path) -> None:
    """Refuse a folder or file someone else owns or may write: loading it runs its code."""
    status = path.stat()
    if hasattr(os, "getuid") and status.st_uid != os.getuid():
        raise NativeUnavailable(f"{path} is owned by uid {status.st_uid}, not this user ({os.getuid()})")
    if status.st_mode & 0o022:
        raise NativeUnavailable(f"{path} can be written by others (mode {oct(status.st_mode & 0o777)})")


def _cpu_features() -> str:
    """The CPU's feature flags where Linux lists them: -march=native code built on one CPU may not
    run on another that shares the cache folder (a home directory on NFS)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _compile(compiler: str, target: Path) -> None:
    """Compile into a temporary file beside `target`, then rename: processes starting together
    never load a half-written library."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *FLAGS, "-o", partial, *map(str, SOURCES), "-lm"],
            check=True,
            capture_output=True,
            timeout=120,
        )
        os.chmod(partial, 0o700)  # whatever the umask: nobody else may write what we load
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def fits(call: AttentionCall) -> bool:
    """Whether `call` is one the C loop computes: decoding rows (one query token each), float32,
    attending all their keys (one row, no mask) or a known prefix of them (`prefix_lengths`)."""
    batch, heads, length, k_dim = call.queries.shape
    kv_heads = call.keys.shape[1]
    return (
        length == 1
        and (call.mask is None and batch == 1 or call.prefix_lengths is not None)
        and call.queries.dtype == call.keys.dtype == call.values.dtype == mx.float32
        and k_dim % LANES == 0
        and heads % kv_heads == 0
        and heads // kv_heads <= MAX_REPEATS
    )


def threads(enough_work: bool) -> int:
    """Threads for a call: KVRQ_ATTENTION_THREADS where set (read once a step, engine/
    cpu_shortcuts.py), else two where there are two cores and enough work for a second thread to
    pay for its start (measured on the 2-core dev machine; more cores would share the same memory
    bandwidth)."""
    configured = current().attention_threads
    if configured > 0:
        return configured
    return _two_or_fewer_cores() if enough_work else 1


@functools.cache
def _two_or_fewer_cores() -> int:
    return min(2, os.cpu_count() or 1)


def _lines_view(array: mx.array) -> np.ndarray:
    """numpy's view of an evaluated (1, heads, length, dim) array whose lines are contiguous
    (a KV buffer's prefix is); a copy where they are not."""
    view = np.asarray(array)
    if view.strides[-1] != view.itemsize or view.strides[-2] != view.shape[-1] * view.itemsize:
        view = np.ascontiguousarray(view)
    return view


def attend_decode_rows(lib: ctypes.CDLL, calls: list[AttentionCall], scale: float) -> mx.array:
    """(rows, heads, 1, value_dim): the attention output of every call's rows, in order. The
    calls' arrays must be evaluated (the caller's one sync of the layer does it)."""
    _, heads, _, k_dim = calls[0].queries.shape
    kv_heads, v_dim = calls[0].keys.shape[1], calls[0].values.shape[-1]
    queries: list[int] = []  # per row: where its query heads, keys and values start
    keys: list[int] = []
    values: list[int] = []
    lengths: list[int] = []  # per row: keys attended
    k_strides: list[int] = []  # per row: floats from one KV head to the next
    v_strides: list[int] = []
    views = []  # the numpy views the pointers point into: alive until the call returns
    for call in calls:
        batch = call.queries.shape[0]
        q = np.ascontiguousarray(np.asarray(call.queries))
        k, v = _lines_view(call.keys), _lines_view(call.values)
        views += [q, k, v]
        prefixes = call.prefix_lengths or (k.shape[2],) * batch
        for b in range(batch):
            queries.append(q.ctypes.data + b * q.strides[0])
            keys.append(k.ctypes.data + b * k.strides[0])
            values.append(v.ctypes.data + b * v.strides[0])
            lengths.append(prefixes[b])
            k_strides.append(k.strides[1] // k.itemsize)
            v_strides.append(v.strides[1] // v.itemsize)
    # Locals, not temporaries: the C call reads these tables, so they must outlive it.
    tables = [np.array(pointers, dtype=np.uintp) for pointers in (queries, keys, values)]
    row_lengths = np.array(lengths, dtype=np.int64)
    head_strides = [np.array(strides, dtype=np.int64) for strides in (k_strides, v_strides)]
    out = np.empty((len(lengths), heads, 1, v_dim), dtype=np.float32)
    status = lib.decode_attention(
        len(lengths),
        *(table.ctypes.data for table in tables),
        row_lengths.ctypes.data,
        *(strides.ctypes.data for strides in head_strides),
        kv_heads,
        heads // kv_heads,
        k_dim,
        v_dim,
        scale,
        out.ctypes.data,
        threads(int(row_lengths.sum()) * kv_heads >= THREAD_MIN_LINES),
    )
    if status != 0:
        raise MemoryError("decode_attention could not get scratch memory")
    return mx.array(out)


def softmax_numerators(lib: ctypes.CDLL, scores: np.ndarray, queries: int) -> np.ndarray | None:
    """The masked softmax's numerators written over `scores` (..., rows, keys), and their sums
    (..., rows, 1); None where the C loop cannot take the array (the caller's numpy path then).
    `queries` > 1: causal, the rows come in groups of that many query tokens, the last tokens of
    the keys; 1: every row sees every key."""
    if scores.dtype != np.float32 or not scores.flags.c_contiguous or not scores.flags.writeable:
        return None
    length = scores.shape[-1]
    rows = scores.size // length if length else 0
    if rows == 0 or queries > length:
        return None
    totals = np.empty((*scores.shape[:-1], 1), dtype=np.float32)
    workers = threads(scores.size >= SOFTMAX_THREAD_MIN_SCORES)
    if lib.softmax_rows(scores.ctypes.data, rows, length, queries, totals.ctypes.data, workers) != 0:
        return None
    return totals


def fits_quantized(call: QuantizedCall) -> bool:
    """Whether the quantized C loop computes `call`: one row's one query token over all its keys,
    float32 queries, scales and biases, groups and dims the loop's vectors divide."""
    batch, heads, length, k_dim = call.queries.shape
    kv_heads, v_dim = call.keys[0].shape[1], call.values[1].shape[-1] * call.group_size
    return (
        batch == 1
        and length == 1
        and call.mask is None
        and call.bits in (8, 4)
        and call.queries.dtype == call.keys[1].dtype == call.values[1].dtype == mx.float32
        and call.group_size % LANES == 0
        and k_dim % call.group_size == 0
        and v_dim % call.group_size == 0
        and heads % kv_heads == 0
        and heads // kv_heads <= MAX_REPEATS
    )


def dequantizable(call: QuantizedCall) -> bool:
    """Whether the C loop can unpack `call`'s K/V into float32 (any query count: prefill chunks)."""
    k_dim = call.queries.shape[-1]
    v_dim = call.values[1].shape[-1] * call.group_size
    return (
        call.bits in (8, 4)
        and call.queries.dtype == call.keys[1].dtype == call.values[1].dtype == mx.float32
        and call.group_size % LANES == 0
        and k_dim % call.group_size == 0
        and v_dim % call.group_size == 0
    )


def attend_quantized_rows(lib: ctypes.CDLL, calls: list[QuantizedCall], scale: float) -> mx.array:
    """(rows, heads, 1, value_dim): every call's attention output, in order; the calls (all of one
    model: same heads, dims, bits and group size) must be evaluated."""
    first = calls[0]
    _, heads, _, k_dim = first.queries.shape
    kv_heads = first.keys[0].shape[1]
    v_dim = first.values[1].shape[-1] * first.group_size
    columns: list[list[int]] = [[] for _ in range(12)]  # q, kq, ks, kb, vq, vs, vb, lengths, 4 strides
    views = []  # the numpy views the pointers point into: alive until the call returns
    for call in calls:
        q = np.ascontiguousarray(np.asarray(call.queries))
        parts = [_lines_view(part) for part in (*call.keys, *call.values)]
        views += [q, *parts]
        for column, view in zip(columns[:7], (q, *parts), strict=True):
            column.append(view.ctypes.data)
        columns[7].append(int(parts[0].shape[2]))
        # head strides: packed lines in bytes (the C loop reads them as bytes), groups in floats
        strides = (
            parts[0].strides[1],
            parts[1].strides[1] // 4,
            parts[3].strides[1],
            parts[4].strides[1] // 4,
        )
        for column, stride in zip(columns[8:], strides, strict=True):
            column.append(stride)
    # Locals, not temporaries: the C call reads these tables, so they must outlive it.
    tables = [np.array(column, dtype=np.uintp if i < 7 else np.int64) for i, column in enumerate(columns)]
    out = np.empty((len(calls), heads, 1, v_dim), dtype=np.float32)
    status = lib.decode_attention_quantized(
        len(calls),
        *(table.ctypes.data for table in tables),
        kv_heads,
        heads // kv_heads,
        k_dim,
        v_dim,
        first.bits,
        first.group_size,
        scale,
        out.ctypes.data,
        threads(int(tables[7].sum()) * kv_heads >= THREAD_MIN_LINES),
    )
    if status != 0:
        raise MemoryError("decode_attention_quantized could not get scratch memory")
    return mx.array(out)


def dequantize_parts(
    lib: ctypes.CDLL, parts: tuple[mx.array, mx.array, mx.array], bits: int, group_size: int
) -> mx.array:
    """(1, heads, length, dim) float32 of one row's evaluated packed K or V (packed, scales, biases):
    a prefill chunk's keys for the float32 attention path (MLX's own dequantize of 4 bits is slow here)."""
    packed, scales, biases = (_lines_view(part) for part in parts)
    _, heads, length, groups = scales.shape
    dim = groups * group_size
    if biases.strides != scales.strides or packed.shape[:3] != scales.shape[:3]:
        raise ValueError("scales and biases must be laid out alike")
    out = np.empty((1, heads, length, dim), dtype=np.float32)
    status = lib.dequantize_heads(
        packed.ctypes.data,
        scales.ctypes.data,
        biases.ctypes.data,
        heads,
        length,
        packed.strides[1],
        scales.strides[1] // 4,
        dim,
        bits,
        group_size,
        out.ctypes.data,
    )
    if status != 0:
        raise ValueError(f"cannot dequantize {bits}-bit K/V in groups of {group_size} here")
    return mx.array(out)
