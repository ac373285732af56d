"""The CPU acceleration behind its one door: one switch convention, KVRQ_CPU_SHORTCUTS=0, the C
library's fallbacks (no sources, no compiler, a cache folder it may not use), built at start and
never in a step, and an engine that still runs with engine/cpu deleted."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine.batch import acceleration
from engine.batch.attention import AttentionCall
from engine.core.params import SamplingParams
from engine.core.switches import SwitchError, count, switch
from engine.cpu import blas, native_attention, split_attention
from engine.cpu.shortcuts import OFF, cpu_shortcuts, in_ragged_step
from tests.engine.test_ragged import make_engine, prompt, run_all
from tests.engine.tiny import tiny_model

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def fresh_library() -> Iterator[None]:
    native_attention.library.cache_clear()
    yield
    native_attention.library.cache_clear()


@pytest.mark.parametrize(("value", "expected"), [("1", True), ("TRUE", True), ("on", True), ("0", False)])
def test_every_switch_reads_the_same_words(
    value: str, expected: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVRQ_TEST_SWITCH", value)
    assert switch("KVRQ_TEST_SWITCH", default=not expected) is expected


def test_an_unknown_switch_value_is_an_error_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVRQ_PAD_ROWS", "nope")
    with pytest.raises(SwitchError, match="KVRQ_PAD_ROWS='nope'"):
        cpu_shortcuts()
    monkeypatch.setenv("KVRQ_ATTENTION_THREADS", "two")
    with pytest.raises(SwitchError, match="KVRQ_ATTENTION_THREADS"):
        count("KVRQ_ATTENTION_THREADS")


def test_unset_and_empty_mean_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVRQ_TEST_SWITCH", raising=False)
    assert switch("KVRQ_TEST_SWITCH") and not switch("KVRQ_TEST_SWITCH", default=False)
    monkeypatch.setenv("KVRQ_TEST_SWITCH", "")
    assert switch("KVRQ_TEST_SWITCH")


def test_one_switch_turns_every_cpu_shortcut_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cpu_shortcuts() != OFF, "on the CPU, by default, the shortcuts are on"
    monkeypatch.setenv("KVRQ_CPU_SHORTCUTS", "0")
    assert cpu_shortcuts() == OFF
    assert acceleration.padded_rows(12, acceleration.step_shortcuts(12, 10_000)) == 12, "no row padding"


def test_the_old_openblas_opt_out_takes_0_as_0() -> None:
    """KVRQ_NO_OPENBLAS=0 used to opt out (any non-empty value did); now it means what it says."""
    assert blas.wanted({"KVRQ_NO_OPENBLAS": "0"})
    assert not blas.wanted({"KVRQ_NO_OPENBLAS": "1"})
    assert not blas.wanted({"KVRQ_OPENBLAS": "0"})
    assert blas.wanted({})


def decoding_row(length: int) -> AttentionCall:
    mx.random.seed(length)
    return AttentionCall(
        mx.random.normal((1, 9, 1, 64)),
        mx.random.normal((1, 3, length, 64)),
        mx.random.normal((1, 3, length, 48)),
    )


def test_numpy_exp_off_keeps_the_c_decode_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """KVRQ_NUMPY_EXP=0 once turned the C decoding loop off too, silently."""
    monkeypatch.setenv("KVRQ_NUMPY_EXP", "0")
    assert native_attention.library() is not None
    calls: list[int] = []
    real = native_attention.attend_decode_rows
    monkeypatch.setattr(
        native_attention, "attend_decode_rows", lambda lib, c, s: calls.append(len(c)) or real(lib, c, s)
    )
    call = decoding_row(700)
    with in_ragged_step(cpu_shortcuts()):
        (got,) = acceleration.attend([call], 0.125, None)
    assert calls == [1]
    want = mx.fast.scaled_dot_product_attention(call.queries, call.keys, call.values, scale=0.125)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-6, rtol=1e-5)


def test_a_step_never_builds_the_library(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse() -> None:
        raise AssertionError("built inside a step")

    monkeypatch.setattr(native_attention, "_build_and_load", refuse)
    assert native_attention.loaded() is None
    with in_ragged_step(cpu_shortcuts()):
        assert split_attention.attend([decoding_row(700)], 0.125, None) is not None, "numpy's split instead"


def test_the_engine_builds_the_library_when_it_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVRQ_NATIVE_CACHE", str(tmp_path))
    engine = make_engine(tiny_model("llama"))
    try:
        assert native_attention.library.cache_info().currsize == 1
        assert native_attention.loaded() is not None
        assert [p.suffix for p in tmp_path.iterdir()] == [".so"]
    finally:
        engine.close()


def test_the_cache_lives_under_xdg_cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVRQ_NATIVE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert native_attention.cache_dir() == tmp_path / "kvrq" / "native"
    assert native_attention.library() is not None
    assert (tmp_path / "kvrq" / "native").stat().st_mode & 0o777 == 0o700


def fall_back(caplog: pytest.LogCaptureFixture, why: str) -> None:
    """The library is refused with one warning saying `why`, and attention still runs (MLX's path)."""
    assert native_attention.library() is None
    warnings = [r.getMessage() for r in caplog.records if "C attention unavailable" in r.getMessage()]
    assert len(warnings) == 1 and why in warnings[0], warnings
    call = decoding_row(300)
    with in_ragged_step(cpu_shortcuts()):
        (got,) = acceleration.attend([call], 0.125, None)
    want = mx.fast.scaled_dot_product_attention(call.queries, call.keys, call.values, scale=0.125)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-6, rtol=1e-5)


def test_missing_sources_fall_back_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("KVRQ_NATIVE_CACHE", str(tmp_path))
    monkeypatch.setattr(native_attention, "SOURCES", (tmp_path / "gone" / "decode_attention.c",))
    fall_back(caplog, "the C sources are not installed")


def test_no_compiler_falls_back_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("KVRQ_NATIVE_CACHE", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(native_attention.shutil, "which", lambda name: None)
    fall_back(caplog, "no C compiler found")


def test_a_read_only_cache_folder_falls_back_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """/proc refuses new folders even to root: a cache folder nobody can create."""
    monkeypatch.setenv("KVRQ_NATIVE_CACHE", "/proc/kvrq-native-cache")
    fall_back(caplog, "could not build into /proc/kvrq-native-cache")


def test_a_cache_folder_others_may_write_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("KVRQ_NATIVE_CACHE", str(shared))
    fall_back(caplog, "can be written by others")
    assert list(shared.iterdir()) == [], "nothing built there"


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="only root can give a folder away")
def test_a_cache_folder_another_user_owns_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o700)
    os.chown(foreign, 65534, 65534)
    monkeypatch.setenv("KVRQ_NATIVE_CACHE", str(foreign))
    fall_back(caplog, "is owned by uid 65534")


def without_cpu(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A copy of engine/ without engine/cpu/, and an environment that imports it before the repo's."""
    copy = tmp_path / "repo"
    copy.mkdir()
    shutil.copytree(REPO / "engine", copy / "engine", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.rmtree(copy / "engine" / "cpu")
    return copy, {**os.environ, "PYTHONPATH": f"{copy}{os.pathsep}{REPO}"}


def test_the_engine_runs_with_the_cpu_package_deleted(tmp_path: Path) -> None:
    """engine/ without engine/cpu/ (a copy): the same greedy tokens as with it, on MLX's own ops."""
    copy, env = without_cpu(tmp_path)
    script = (
        "import sys, engine.batch.acceleration as a\n"
        "from engine.batch.engine import BlockPoolBatchEngine\n"
        "from engine.core.params import SamplingParams\n"
        "from tests.engine.tiny import ByteTokenizer, tiny_model\n"
        "assert 'engine.cpu' not in sys.modules and a.prepare().endswith('not installed)')\n"
        "e = BlockPoolBatchEngine(tiny_model('llama'), ByteTokenizer(), model_name='tiny-llama',\n"
        "                         pool_blocks=64, max_batch=8, max_context=4096)\n"
        "p = SamplingParams(max_tokens=6, stop_tokens=())\n"
        "uids = [e.submit(None, [1 + (i * 7 + n * 13) % 250 for i in range(n)], p) for n in (5, 300, 40)]\n"
        "done = {}\n"
        "while e.has_work():\n"
        "    done.update((c.uid, c.token_ids) for c in e.step().completions)\n"
        "assert 'engine.cpu' not in sys.modules\n"
        "print([done[u] for u in uids])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=copy, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    engine = make_engine(tiny_model("llama"))
    params = SamplingParams(max_tokens=6, stop_tokens=())
    uids = [engine.submit(None, prompt(n, salt=n), params) for n in (5, 300, 40)]
    finished = run_all(engine)
    engine.close()
    assert done.stdout.strip() == str([finished[uid].token_ids for uid in uids])


def test_the_worker_starts_with_the_cpu_package_deleted(tmp_path: Path) -> None:
    """`kvrq worker` without engine/cpu/ (a copy): its start (the OpenBLAS re-exec, the settings, the
    engine on a tiny model, the store) runs on MLX's own ops, up to where it waits for Redis."""
    copy, env = without_cpu(tmp_path)
    script = (
        "import sys, engine.models.load, worker.process\n"
        "from tests.engine.tiny import ByteTokenizer, tiny_model\n"
        "from worker.cli.main import main\n"
        "class Started(Exception): pass\n"
        "def started(url): raise Started(url)\n"
        "engine.models.load.load_model = lambda name: (tiny_model('llama'), ByteTokenizer())\n"
        "worker.process.wait_for_redis = started\n"
        "try:\n"
        "    main(['worker', '--model', 'tiny-llama', '--pool-blocks', '64', '--store', 'disk:cache'])\n"
        "except Started:\n"
        "    assert 'engine.cpu' not in sys.modules\n"
        "    print('started')\n"
    )
    env |= {"KVRQ_LOG_LEVEL": "info"}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=copy, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "started", done.stderr[-3000:]
    assert "CPU shortcuts: none (engine/cpu is not installed)" in done.stderr
