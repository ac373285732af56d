"""`kvrq up --sentinel`: a primary, a replica and three sentinels with the failover settings kvrq relies
on, a real worker on the redis+sentinel:// URL, and a Ctrl-C that stops it all without a failover."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from redis import Redis

from producer.client import Producer
from tests.conftest import free_port
from tests.worker.stackhelp import ShellCommand, descendants, wait_gone
from worker.cli.stack import SENTINEL_PORT_OFFSET, port_is_free

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STARTUP_S = 240  # model load on a busy machine


def stack_port() -> int:
    """A Redis port whose replica (+1) and sentinel ports (+20000, +1, +2) are free too."""
    for _ in range(100):
        port = free_port()
        wanted = [port + 1, *(port + SENTINEL_PORT_OFFSET + n for n in range(3))]
        if port + SENTINEL_PORT_OFFSET + 2 < 65536 and all(port_is_free(p) for p in wanted):
            return port
    raise AssertionError("no free port set")


def test_kvrq_up_sentinel_serves_jobs_and_stops_without_failing_over(tmp_path: Path) -> None:
    port = stack_port()
    command = f"{sys.executable} -m worker.cli up --sentinel --no-dashboard --no-http --redis-port {port}"
    run = ShellCommand(f"{command} --dir {tmp_path / 'data'}", tmp_path, {})
    try:
        run.wait_for(lambda: "worker ready" in run.log(), STARTUP_S, "no worker became ready")
        hosts = ",".join(f"127.0.0.1:{port + SENTINEL_PORT_OFFSET + n}" for n in range(3))
        url = f"redis+sentinel://{hosts}/kvrq/0"
        assert f"enqueue to {url}" in run.log()
        for data_port, role in ((port, "master"), (port + 1, "slave")):
            server = Redis(port=data_port)
            assert server.info("replication")["role"] == role
            assert server.config_get("min-replicas-*") == {
                "min-replicas-to-write": "1",
                "min-replicas-max-lag": "10",
            }
        with Producer(url) as producer:
            result = producer.submit({"prompt": "The sky is", "max_tokens": 4}).result(timeout=120)
        assert result.text
        children = descendants(run.proc.pid)
        assert run.ctrl_c() == 0, run.log()
        assert wait_gone(children) == []
        assert "+switch-master" not in run.log() and "+odown" not in run.log()
    finally:
        if run.proc.poll() is None:
            run.kill_all()
