"""kvrq as a user installs it: `pip install "kvrq[worker]"` from the built wheel into a fresh venv,
then the `kvrq` script pip wrote runs a job whose prompt takes the C attention path to `finished`.

The repo's editable install hid a wheel without the C sources (every CPU worker failed its first
long job with FileNotFoundError). The fresh venv gets the wheel itself, installed by pip (so its
console script is the one users run), and of this test venv's packages only those the wheel's
`worker` extra needs, followed through their own requirements as pip would (linked, not
downloaded): a dependency the extra leaves out is missing there, and a pin the test venv does not
satisfy fails the test. The worker runs outside the repo, so nothing of the checkout is on its
path; its C library is built from the wheel's sources into a fresh XDG cache folder.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import zipfile
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from redis import Redis

from engine.models.gguf_smollm2 import gguf_path
from producer.client import Producer
from tests.worker.procs import RedisProcess, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
EXTRA = "worker"


def run(*command: str | Path, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"{command}: {done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def needed(distribution: metadata.Distribution, extras: Iterable[str] = ()) -> list[Requirement]:
    """`distribution`'s requirements (its Requires-Dist) that apply here with `extras` asked for."""
    requirements = [Requirement(line) for line in distribution.requires or ()]
    return [
        r
        for r in requirements
        if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in ("", *extras))
    ]


def link_dependencies(roots: list[Requirement], packages: Path) -> None:
    """Link into `packages` the test venv's distributions that `roots` need, with theirs in turn."""
    todo, seen = list(roots), set[tuple[str, frozenset[str]]]()
    while todo:
        requirement = todo.pop()
        key = (canonicalize_name(requirement.name), frozenset(requirement.extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            distribution = metadata.distribution(requirement.name)
        except metadata.PackageNotFoundError:
            continue  # a requirement of the wheel is checked by the test; a deeper one is pip's business
        assert distribution.files is not None, f"{requirement.name} has no RECORD to link"
        for top in {f.parts[0] for f in distribution.files if f.parts[0] not in ("..", "__pycache__")}:
            if not (packages / top).exists():
                (packages / top).symlink_to(Path(str(distribution.locate_file(top))))
        todo += needed(distribution, requirement.extras)


def unmet(requirements: list[Requirement], path: list[str]) -> list[str]:
    """Each of `requirements` that no distribution on `path` satisfies, name and version."""
    missing = []
    for requirement in requirements:
        versions = [d.version for d in metadata.distributions(name=requirement.name, path=path)]
        if not any(requirement.specifier.contains(v, prereleases=True) for v in versions):
            missing.append(f"{requirement} (found: {', '.join(versions) or 'none'})")
    return missing


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding the wheel built from a copy of the tracked files and its worker extra's
    dependencies; returns the `kvrq` script pip wrote there."""
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
    run(sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel)
    path = [
        p for p in run(python, "-c", "import sys; print('\\n'.join(sys.path))", cwd=root).splitlines() if p
    ]
    (kvrq,) = metadata.distributions(name="kvrq", path=path)
    packages = Path(str(kvrq.locate_file("")))
    link_dependencies(needed(kvrq, [EXTRA]), packages)
    assert unmet(needed(kvrq, [EXTRA]), path) == [], f"kvrq[{EXTRA}] needs what the fresh venv lacks"
    where = run(python, "-c", "import engine, worker; print(engine.__file__)", cwd=root)
    assert where.startswith(str(packages)), f"engine imported from {where}, not the installed wheel"
    assert (venv / "bin" / "kvrq").read_text().startswith(f"#!{python}"), "pip's console script"
    return venv / "bin" / "kvrq"


def test_a_long_prompt_finishes_on_a_worker_installed_from_the_wheel(
    installed: Path, redis_proc: RedisProcess, tmp_path: Path
) -> None:
    work = tmp_path / "outside-the-repo"
    work.mkdir()
    xdg = tmp_path / "xdg-cache"
    # Nor its OpenBLAS preload: the script re-execs itself with OpenBLAS, as a user's would.
    dropped = ("KVRQ_NATIVE_CACHE", "PYTHONPATH", "LD_PRELOAD", "KVRQ_BLAS_REEXEC")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env |= {"XDG_CACHE_HOME": str(xdg), "KVRQ_HEARTBEAT_INTERVAL": "0.5"}
    env["KVRQ_SMOLLM2_GGUF"] = str(gguf_path())  # the builtin model's file, a separate install (README)
    log_path = tmp_path / "worker.log"
    command = [installed, "worker", "--redis", redis_proc.url, "--name", "wheel-worker"]
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
        assert "not preloaded" not in text, "the script's re-exec preloaded OpenBLAS"
        assert list((xdg / "kvrq" / "native").glob("attention-*.so")), "built from the wheel's sources"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
