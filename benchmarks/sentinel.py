"""A Sentinel topology on loopback: one primary, one replica, three sentinels (real redis-server), for the
fleet tests and bench_store_topologies.py.

The data servers run with kvrq's shipped failover settings (worker.cli.stack.SENTINEL_DATA_CONFIG):
`min-replicas-to-write 1`, so a primary that lost its replica refuses writes instead of acknowledging
ones a failover would drop.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from redis import Redis
from redis.exceptions import RedisError

from benchmarks.procs import accepts, redis_server, wait_for
from worker.cli.spawn import free_port
from worker.cli.stack import SENTINEL_DATA_CONFIG

MASTER = "kvrq"


class SentinelTopology:
    """Start, inspect and fail over a primary + replica watched by three sentinels."""

    def __init__(
        self,
        workdir: Path,
        *,
        sentinels: int = 3,
        data_config: Sequence[str] = SENTINEL_DATA_CONFIG,
        binary: str | None = None,
    ) -> None:
        """`data_config`: extra redis.conf lines of both data servers (a cache store's shard may run
        without `min-replicas-to-write`: a lost cache write is a counted miss, not lost data)."""
        self.binary = binary or redis_server()
        self.workdir = workdir
        self.data_config = tuple(data_config)
        self.data_ports = [free_port(), free_port()]
        self.sentinel_ports = [free_port() for _ in range(sentinels)]
        self.procs: list[subprocess.Popen[bytes]] = []
        self._by_port: dict[int, subprocess.Popen[bytes]] = {}  # the data servers' current processes

    @property
    def url(self) -> str:
        """The kvrq URL for this topology's queue Redis."""
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{MASTER}/0"

    def start(self) -> SentinelTopology:
        primary, replica = self.data_ports
        try:
            self._spawn("primary", self._data_config(primary, None))
            self._spawn("replica", self._data_config(replica, primary))
            synced = lambda: self.role(replica) == "slave" and self._linked(replica)  # noqa: E731
            wait_until(synced, 15, "replica never synced")
            for port in self.sentinel_ports:
                self._spawn(f"sentinel-{port}", self._sentinel_config(port, primary), sentinel=True)
            wait_until(self._sentinels_agree, 20, "sentinels never saw the replica and each other")
        except BaseException:
            self.stop()  # nothing left running when a start fails
            raise
        return self

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        self.procs.clear()

    def primary_port(self) -> int:
        """The port the sentinels announce as primary now."""
        address: Any = self.sentinel(0).sentinel_get_master_addr_by_name(MASTER)
        return int(address[1])

    def sentinel(self, index: int) -> Redis:
        return Redis(host="127.0.0.1", port=self.sentinel_ports[index], socket_timeout=2)

    def data(self, port: int) -> Redis:
        return Redis(host="127.0.0.1", port=port, socket_timeout=2)

    def role(self, port: int) -> str:
        try:
            return str(self.data(port).info("replication")["role"])
        except RedisError:
            return "down"

    def failover(self, timeout: float = 30) -> int:
        """SENTINEL FAILOVER once every sentinel sees a healthy replica; return the new primary's port
        once the old one serves as its replica and the new one takes writes again."""
        old = self.primary_port()
        wait_until(self._ready_to_fail_over, timeout, f"no replica fit to promote:\n{self._events()}")
        self.sentinel(0).sentinel_failover(MASTER)
        wait_until(
            lambda: self.primary_port() != old, timeout, f"no new primary announced:\n{self._events()}"
        )
        new = self.primary_port()
        demoted = lambda: self.role(old) == "slave" and self._linked(old)  # noqa: E731
        wait_until(demoted, timeout, f"old primary never demoted:\n{self._events()}")
        return new

    def kill_primary(self, timeout: float = 30) -> tuple[int, int]:
        """kill -9 the primary's redis-server; return (its port, the promoted replica's port) once the
        sentinels announce the replica and it takes writes as primary."""
        old = self.kill_primary_now(timeout)
        return old, self.wait_promoted(old, timeout)

    def kill_primary_now(self, timeout: float = 30) -> int:
        """kill -9 the primary's redis-server once a replica is fit to replace it; return its port."""
        old = self.primary_port()
        wait_until(
            self._ready_to_fail_over_unchecked, timeout, f"no replica fit to promote:\n{self._events()}"
        )
        proc = self._by_port[old]
        proc.kill()
        proc.wait(timeout=10)
        return old

    def wait_promoted(self, old: int, timeout: float = 30) -> int:
        """The port of the primary that replaced `old`, once announced and taking writes."""
        wait_until(
            lambda: self.primary_port() != old, timeout, f"no new primary announced:\n{self._events()}"
        )
        new = self.primary_port()
        wait_until(lambda: self.role(new) == "master", timeout, f"{new} never became primary")
        return new

    def restart(self, port: int, timeout: float = 30) -> None:
        """Start a killed data server again on its port; the sentinels make it the primary's replica."""
        name = "primary" if port == self.data_ports[0] else "replica"
        self._spawn(name, (self.workdir / f"{name}.conf").read_text())
        linked = lambda: self.role(port) == "slave" and self._linked(port)  # noqa: E731
        wait_until(linked, timeout, f"{port} did not rejoin as a replica:\n{self._events()}")

    def _ready_to_fail_over_unchecked(self) -> bool:
        """As _ready_to_fail_over, without asking the primary for min-replicas (it may not set it)."""
        return self._ready_to_fail_over(check_min_replicas=False)

    def _ready_to_fail_over(self, check_min_replicas: bool = True) -> bool:
        """Every sentinel agrees on the primary and lists a replica that is up and linked to it."""
        primary = self.primary_port()
        for index in range(len(self.sentinel_ports)):
            state: Any = self.sentinel(index).sentinel_master(MASTER)
            if int(state["port"]) != primary:
                return False
            replicas: Any = self.sentinel(index).sentinel_slaves(MASTER)
            fit = [
                r
                for r in replicas
                if not (r["is_sdown"] or r["is_odown"]) and r["master-link-status"] == "ok"
            ]
            if not fit:
                return False
        if not check_min_replicas:
            return True
        return int(self.data(primary).info("replication")["min_slaves_good_slaves"]) >= 1

    def _events(self) -> str:
        """The sentinels' failover events, for a failure message."""
        marks = ("failover", "switch-master", "selected-slave", "sdown", "odown", "elected", "NOGOOD")
        lines = []
        for port in self.sentinel_ports:
            log = (self.workdir / f"sentinel-{port}.log").read_text(errors="replace").splitlines()
            lines += [f"{port}: {line}" for line in log if any(mark in line for mark in marks)]
        return "\n".join(lines[-30:])

    def _linked(self, port: int) -> bool:
        info = self.data(port).info("replication")
        return info.get("master_link_status") == "up"

    def _sentinels_agree(self) -> bool:
        try:
            for index in range(len(self.sentinel_ports)):
                state: Any = self.sentinel(index).sentinel_master(MASTER)
                peers = len(self.sentinel_ports) - 1
                if int(state["num-slaves"]) < 1 or int(state["num-other-sentinels"]) < peers:
                    return False
            return True
        except RedisError:
            return False

    def _data_config(self, port: int, replica_of: int | None) -> str:
        lines = [
            f"port {port}",
            "bind 127.0.0.1",
            'save ""',
            "appendonly no",
            f"dir {self.workdir}",
            f"dbfilename dump-{port}.rdb",
            *self.data_config,
        ]
        if replica_of is not None:
            lines.append(f"replicaof 127.0.0.1 {replica_of}")
        return "\n".join(lines) + "\n"

    def _sentinel_config(self, port: int, primary: int) -> str:
        return (
            f"port {port}\nbind 127.0.0.1\ndir {self.workdir}\n"
            f"sentinel monitor {MASTER} 127.0.0.1 {primary} 2\n"
            f"sentinel down-after-milliseconds {MASTER} 1000\n"
            f"sentinel failover-timeout {MASTER} 3000\n"
        )

    def _spawn(self, name: str, config: str, *, sentinel: bool = False) -> None:
        path = self.workdir / f"{name}.conf"
        path.write_text(config)
        argv = [self.binary, str(path), *(["--sentinel"] if sentinel else [])]
        with open(self.workdir / f"{name}.log", "ab") as log:  # the child keeps its own copy
            self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))
        port = int(config.split()[1])
        self._by_port[port] = self.procs[-1]
        wait_until(lambda: accepts(port), 10, f"{name} did not start on port {port}")


def wait_until(condition: Callable[[], bool], timeout: float, message: str, interval: float = 0.05) -> None:
    """procs.wait_for, where a server that does not answer yet counts as "not yet"."""

    def answered() -> bool:
        try:
            return condition()
        except (OSError, RedisError):
            return False

    wait_for(answered, timeout, message, interval)
