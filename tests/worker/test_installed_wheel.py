"""kvrq as a user installs it: the built wheel, installed non-editable into a fresh venv, runs a
job whose prompt takes the C attention path to `finished` through a real worker.

The repo's editable install hid a wheel without the C sources (every CPU worker failed its first
long job with FileNotFoundError). The fresh venv gets the wheel itself; its dependencies (mlx,
mlx-lm, ... : the worker extra) come from this test venv's site-packages through a .pth line, so
the test needs no download. The worker runs outside the repo, so nothing of the checkout is on
its path; its C library is built from the wheel's sources into a fresh XDG cache folder.
"""

from __future__ import annotations

import os
import signal
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from redis import Redis

from producer.client import Producer
from tests.worker.procs import RedisProcess, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def run(*command: str | Path, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"{command}: {done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding the wheel built from a copy of the tracked files; returns its python."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    files = run("git", "ls-files", "-z", cwd=REPO).split("\0")
    for name in filter(None, files):
        target = source / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes((REPO / name).read_bytes())
    run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", root, source)
    (wheel,) = root.glob("kvrq-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {"engine/cpu/native/decode_attention.c", "engine/cpu/native/vector_math.h"} <= set(names)
    venv = root / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    packages = Path(run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())
    run(sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", packages, wheel)
    (packages / "dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    where = run(python, "-c", "import engine, worker; print(engine.__file__)", cwd=root)
    assert where.startswith(str(packages)), f"engine imported from {where}, not the installed wheel"
    return python


def test_a_long_prompt_finishes_on_a_worker_installed_from_the_wheel(
    installed: Path, redis_proc: RedisProcess, tmp_path: Path
) -> None:
    work = tmp_path / "outside-the-repo"
    work.mkdir()
    xdg = tmp_path / "xdg-cache"
    env = {k: v for k, v in os.environ.items() if k not in ("KVRQ_NATIVE_CACHE", "PYTHONPATH")}
    env |= {"XDG_CACHE_HOME": str(xdg), "KVRQ_HEARTBEAT_INTERVAL": "0.5"}
    log_path = tmp_path / "worker.log"
    command = [installed, "-m", "worker.cli", "worker", "--redis", redis_proc.url, "--name", "wheel-worker"]
    command += ["--store", f"disk:{work / 'cache'}"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [str(c) for c in command], cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT
        )
    try:
        connection = Redis.from_url(redis_proc.url)
        wait_for(
            lambda: proc.poll() is not None or connection.sismember("rq:workers", "rq:worker:wheel-worker"),
            240,
            "the installed worker did not register",
        )
        assert proc.poll() is None, log_path.read_text()
        briefing = " ".join(f"Fact {i}: the meeting room {i} is on floor {i % 7}." for i in range(110))
        job = Producer(redis_proc.url).submit(
            {"prompt": briefing + "\nWhich floor is room 12 on?", "max_tokens": 4}
        )
        result = job.result(timeout=300)
        assert result.usage.prompt_tokens > 1000
        assert result.finish_reason in ("stop", "length")
        text = log_path.read_text()
        assert "CPU shortcuts: numpy_exp, pad_rows, native_attention" in text, text[-3000:]
        assert list((xdg / "kvrq" / "native").glob("attention-*.so")), "built from the wheel's sources"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
