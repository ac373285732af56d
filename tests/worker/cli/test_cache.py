"""`kvrq cache list|show|delete|pin|unpin` against a real disk store and a real redis-server store."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from store.backend import BlockBackend
from store.disk import DiskStore
from store.redis_store import RedisStore
from tests.store.conftest import make_cache, tiny_spec, tokens
from worker.cli.main import main

pytestmark = pytest.mark.integration
PREFIX = tokens(64, seed=42)  # 4 full blocks: shared by the agents that have them


@pytest.fixture(params=["disk", "redis"])
def store_uri(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, BlockBackend]]:
    store: BlockBackend
    if request.param == "disk":
        store = DiskStore(tmp_path / "cache", tiny_spec())
        uri = f"disk:{tmp_path / 'cache'}"
    else:
        uri = request.getfixturevalue("redis_url")
        store = RedisStore(uri, tiny_spec())
    # Apart in time: a file's mtime (the disk store's last use) may tick only every few milliseconds.
    store.put("alice", make_cache(store.spec, PREFIX + tokens(10, seed=1)))
    time.sleep(0.05)
    store.put("bob", make_cache(store.spec, PREFIX + tokens(20, seed=2)))
    time.sleep(0.05)
    store.put("carol", make_cache(store.spec, tokens(5, seed=3)))
    yield uri, store
    store.close()


def cache(uri: str, *args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["cache", "--store", uri, *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_list_and_show_give_tokens_size_last_use_shared_blocks_and_pin(
    store_uri: tuple[str, BlockBackend], capsys: pytest.CaptureFixture[str]
) -> None:
    uri, store = store_uri
    assert cache(uri, "pin", "bob", capsys=capsys)[:2] == (0, "agent bob: pinned\n")
    code, out, _ = cache(uri, "list", capsys=capsys)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == [
        *("AGENT", "NAMESPACE", "TOKENS", "SIZE", "LAST", "USE", "SHARED/ALL", "BLOCKS", "PINNED")
    ]
    rows = {line.split()[0]: line.split() for line in lines[1:4]}
    assert {row[1] for row in rows.values()} == {"default"}  # the store's namespace, recorded by each put
    # full blocks live in the shared area (stored once for every agent with the same tokens)
    assert rows["bob"][2] == "84" and rows["bob"][-2:] == ["5/6", "yes"]  # 84 tokens: 5 full blocks + 1
    assert rows["alice"][2] == "74" and rows["alice"][-1] == "4/5"
    assert rows["carol"][2] == "5" and rows["carol"][-1] == "0/1"
    assert [line.split()[0] for line in lines[1:4]] == ["carol", "bob", "alice"]  # most recent first
    assert lines[4].startswith("3 agent(s), ")
    info = store.info("alice")
    assert info is not None
    code, out, _ = cache(uri, "show", "alice", capsys=capsys)
    assert code == 0 and "  tokens: 74" in out and f"({info.nbytes} bytes, quantization none)" in out
    assert "  blocks: 5, of them in the shared area: 4" in out and "  pinned: no" in out
    assert "  namespace: default" in out
    assert "s ago" in out


def test_list_shows_and_filters_by_namespace(
    store_uri: tuple[str, BlockBackend], capsys: pytest.CaptureFixture[str]
) -> None:
    """A store opened for another tenant keeps its full blocks apart; the CLI says whose each agent is."""
    uri, store = store_uri
    other: BlockBackend
    if isinstance(store, DiskStore):
        other = DiskStore(store.root, tiny_spec(), namespace="team-b")
    else:
        other = RedisStore(uri, tiny_spec(), namespace="team-b")
    with contextlib.closing(other):
        other.put("dave", make_cache(other.spec, PREFIX + tokens(3, seed=4)))
    dave = store.info("dave")
    assert dave is not None and dave.namespace == "team-b" and dave.shared_blocks == 4
    code, out, _ = cache(uri, "list", "--namespace", "team-b", capsys=capsys)
    assert code == 0
    assert [line.split()[:3] for line in out.splitlines()[1:-1]] == [["dave", "team-b", "67"]]
    code, out, _ = cache(uri, "list", "--namespace", "default", capsys=capsys)
    assert sorted(line.split()[0] for line in out.splitlines()[1:-1]) == ["alice", "bob", "carol"]
    assert cache(uri, "list", "--namespace", "nobody", capsys=capsys)[:2] == (
        0,
        "no agent caches in namespace nobody\n",
    )
    assert "  namespace: team-b" in cache(uri, "show", "dave", capsys=capsys)[1]


def test_delete_pin_unpin_and_their_errors(
    store_uri: tuple[str, BlockBackend], capsys: pytest.CaptureFixture[str]
) -> None:
    uri, store = store_uri
    assert cache(uri, "delete", "alice", capsys=capsys)[:2] == (0, "agent alice: deleted\n")
    assert store.info("alice") is None and store.get("bob") is not None  # bob keeps the shared prefix
    assert cache(uri, "delete", "alice", capsys=capsys) == (
        1,
        "",
        "agent alice: has no cache in this store\n",
    )
    assert cache(uri, "pin", "nobody", capsys=capsys)[0] == 1
    assert cache(uri, "unpin", "bob", capsys=capsys) == (1, "", "agent bob: was not pinned\n")
    assert cache(uri, "pin", "bob", "carol", capsys=capsys)[0] == 0
    assert cache(uri, "unpin", "carol", capsys=capsys)[:2] == (0, "agent carol: unpinned\n")
    assert [store.info(a).pinned for a in ("bob", "carol")] == [True, False]  # type: ignore[union-attr]
    code, _, err = cache(uri, "show", "../etc", capsys=capsys)
    assert code == 2 and "agent id" in err
    assert cache(uri, "show", "alice", capsys=capsys) == (1, "", "no cache for agent alice\n")


def test_a_path_without_a_store_is_refused_not_created(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = cache(f"disk:{tmp_path / 'typo'}", "list", capsys=capsys)
    assert code == 2 and "no kvrq store at" in err
    assert not (tmp_path / "typo").exists()


def test_kvrq_cache_imports_no_mlx(tmp_path: Path) -> None:
    DiskStore(tmp_path / "cache", tiny_spec()).close()
    script = (
        "import sys; from worker.cli.main import main; "
        f"code = main(['cache', '--store', 'disk:{tmp_path / 'cache'}', 'list']); "
        "assert not [m for m in sys.modules if m.split('.')[0] == 'mlx'], 'mlx imported'; sys.exit(code)"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "no agent caches\n"


def test_a_shard_that_went_away_is_an_error_line_not_a_traceback(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as probe:  # a loopback port nothing listens on
        probe.bind(("127.0.0.1", 0))
        gone = f"redis://127.0.0.1:{probe.getsockname()[1]}/0"
    code, out, err = cache(f"shards:{redis_url}|{gone}", "list", capsys=capsys)
    assert code == 1 and out == ""
    assert err.startswith("kvrq cache: the store did not answer:") and "Traceback" not in err
