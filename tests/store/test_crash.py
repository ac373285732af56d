"""Crash safety: `kill -9` in the middle of puts leaves the previous or the new cache, never a half one;
a full disk or a full Redis fails the put (counted, logged, in its future) and loses nothing.

The writer is a real child process (tests/store/crash_writer.py) on a real disk directory or
a real redis-server. The synthetic KV is a function of (position, token), and the versions
differ in length and tail, so a cache mixing blocks of two puts cannot equal
`make_cache(spec, got.token_ids)` for any version.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from store.disk import DiskStore
from store.factory import open_store
from store.redis_store import RedisStore
from tests.conftest import RedisServer
from tests.store.conftest import assert_same_cache, make_cache, redis_value_keys, tiny_spec, tokens
from tests.store.crash_writer import AGENT, REDIS_PREFIX, crash_spec, crash_versions, open_crash_backend

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_ROUNDS = 5
CHAOS_ROUNDS = 60
CORRUPT = ("checksum", "truncated", "bad_block", "bad_manifest", "agent_mismatch", "missing_block")


def _kill_during_puts(kind: str, location: str, rng: random.Random) -> None:
    """Start the writer, let it put for a random while, then SIGKILL it."""
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.store.crash_writer", kind, location],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        try:
            child.wait(timeout=rng.uniform(0.05, 1.0))
        except subprocess.TimeoutExpired:
            pass
        else:
            raise AssertionError(f"the writer exited on its own with {child.returncode}")
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
        if child.stdout is not None:
            child.stdout.close()


def _check(kind: str, location: str) -> None:
    """A fresh store's get: a complete cache of one of the versions put."""
    backend = open_crash_backend(kind, location)
    try:
        got = backend.get(AGENT)
        stats = backend.stats()
        assert all(stats[f"miss_{reason}"] == 0 for reason in CORRUPT), stats
        assert got is not None, f"the previous cache was lost: {stats}"
        versions = crash_versions()
        assert got.token_ids in versions, f"{got.n_tokens} tokens match no version put"
        got.validate(backend.spec)
        assert_same_cache(got, make_cache(backend.spec, got.token_ids))  # no block of another put
    finally:
        backend.close()


def _half_written(kind: str, location: str) -> bool:
    """Whether the killed writer left a put half done (temp files, unreferenced blocks)."""
    return bool(_stray(kind, location, put_first=False, pending_too=True))


def _stray(kind: str, location: str, *, put_first: bool = True, pending_too: bool = False) -> list[str]:
    """Files or keys the current manifest does not reference (after one more put, by default, which
    must clean up after a crashed one: on disk nothing may remain; in Redis only blocks still on their
    provisional expiry, unless `pending_too`)."""
    backend = open_crash_backend(kind, location)
    try:
        if put_first:
            assert backend.put(AGENT, make_cache(backend.spec, crash_versions()[0]))
        manifest = backend.read_manifest(AGENT)
        assert manifest is not None
        if isinstance(backend, DiskStore):
            names = {ref.name for ref in manifest.blocks}
            directory = backend._agent_dir(AGENT)
            stray = [
                p.name
                for p in (directory / "blocks").iterdir()
                if p.name.removesuffix(".safetensors") not in names
            ]
            stray += [p.name for p in directory.iterdir() if p.name.startswith(".tmp-")]
            return stray
        assert isinstance(backend, RedisStore)
        client = backend._client
        referenced = set(backend.keys.of_refs(AGENT, manifest.blocks, manifest.part_bytes))
        keys = redis_value_keys(client, REDIS_PREFIX, persistent_only=not pending_too)
        return sorted(keys - referenced)
    finally:
        backend.close()


def _rounds(kind: str, location: str, rounds: int, seed: int) -> None:
    """`rounds` kills (more, up to 4x, until one lands inside a put: most do, but not every one)."""
    rng = random.Random(seed)
    first = open_crash_backend(kind, location)
    assert first.put(AGENT, make_cache(first.spec, crash_versions()[0]))  # a previous cache to keep
    first.close()
    done = half_written = 0
    while done < rounds or (half_written == 0 and done < 4 * rounds):
        _kill_during_puts(kind, location, rng)
        half_written += _half_written(kind, location)
        _check(kind, location)
        done += 1
    assert half_written > 0, "no kill landed inside a put: the test proved nothing"
    assert _stray(kind, location) == []


@pytest.fixture(params=["disk", "redis"])
def crash_store(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str]:
    """(kind, location) of the store the writer puts to: a fresh directory, or a redis-server of its own."""
    if request.param == "disk":
        location = str(tmp_path / "store")
        DiskStore(location, crash_spec()).close()
        return "disk", location
    server: RedisServer = request.getfixturevalue("own_redis_server")
    return "redis", server.url


def test_kill_during_puts_leaves_a_whole_cache(crash_store: tuple[str, str]) -> None:
    kind, location = crash_store
    _rounds(kind, location, DEFAULT_ROUNDS, seed=1 if kind == "disk" else 2)


@pytest.mark.chaos
def test_chaos_kill_during_puts(crash_store: tuple[str, str]) -> None:
    kind, location = crash_store
    _rounds(kind, location, CHAOS_ROUNDS, seed=3 if kind == "disk" else 4)


# --- a full disk, a full Redis -----------------------------------------------------------------------
@pytest.fixture
def tiny_filesystem(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs mounted for this test (needs root)."""
    mountpoint = tmp_path / "small"
    mountpoint.mkdir()
    reason = None
    if os.geteuid() != 0:
        reason = "mounting a 2 MiB tmpfs needs root"
    else:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mountpoint)],
            capture_output=True,
            text=True,
        )
        if done.returncode:
            reason = f"mount -t tmpfs failed: {done.stderr.strip()}"
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(
                f"the disk-full test cannot run: {reason} (CI must run it as root with mount allowed)"
            )
        pytest.skip(reason)
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", str(mountpoint)], check=True)


def test_a_full_disk_fails_the_put_and_keeps_the_previous_cache(
    tiny_filesystem: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spec = tiny_spec()  # 3 KB per token
    location = tiny_filesystem / "store"
    store = open_store(f"disk:{location}", spec)
    previous = make_cache(spec, tokens(100))  # 300 KB
    assert store.put("a", previous).result(timeout=30) is True
    too_big = make_cache(spec, tokens(100) + tokens(900, seed=1))  # 3 MB on a 2 MB filesystem
    with caplog.at_level(logging.ERROR, logger="kvrq.store"):
        future = store.put("a", too_big)
        error = future.exception(timeout=30)
    assert isinstance(error, OSError) and error.errno == errno.ENOSPC
    assert store.stats()["write_errors"] == 1
    assert "'a'" in caplog.text and "No space left" in caplog.text
    assert_same_cache(DiskStore(location, spec).get("a"), previous)  # what another worker reads
    leftovers = [p.name for p in location.rglob(".tmp-*")]
    assert leftovers == []
    other = make_cache(spec, tokens(50, seed=2))
    assert store.put("b", other).result(timeout=30) is True  # the store keeps working
    assert_same_cache(DiskStore(location, spec).get("b"), other)
    store.close()


def test_a_full_redis_fails_the_put_and_keeps_the_previous_cache(own_redis_server: RedisServer) -> None:
    spec = tiny_spec()
    client = redis.Redis.from_url(own_redis_server.url)
    store = open_store(own_redis_server.url, spec, prefix="full:")
    previous = make_cache(spec, tokens(100))
    assert store.put("a", previous).result(timeout=30) is True
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory", used + 1_000_000)  # room for ~300 more tokens, with noeviction
    client.config_set("maxmemory-policy", "noeviction")
    future = store.put("a", make_cache(spec, tokens(100) + tokens(900, seed=1)))
    error = future.exception(timeout=30)
    assert isinstance(error, redis.exceptions.OutOfMemoryError)
    assert store.stats()["write_errors"] == 1
    fresh = RedisStore(own_redis_server.url, spec, prefix="full:")
    assert_same_cache(fresh.get("a"), previous)
    manifest = fresh.read_manifest("a")
    assert manifest is not None
    referenced = set(fresh.keys.of_refs("a", manifest.blocks, manifest.part_bytes))
    stray = redis_value_keys(client, "full:", persistent_only=True) - referenced
    assert stray == set()  # the failed put removed the blocks it had written
    other = make_cache(spec, tokens(50, seed=2))
    assert store.put("b", other).result(timeout=30) is True
    assert_same_cache(fresh.get("b"), other)
    fresh.close()
    store.close()
    client.close()
