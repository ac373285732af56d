"""benchmarks/sentinel.py's Sentinel topology (one primary, one replica, three sentinels), with the tests'
rule for a missing redis-server: skipped locally, failed under CI."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from benchmarks import sentinel as shared
from benchmarks.sentinel import MASTER, wait_until
from tests.conftest import REDIS_SERVER_HINT, require_binary
from worker.cli.stack import SENTINEL_DATA_CONFIG

__all__ = ["MASTER", "SentinelTopology", "wait_until"]


class SentinelTopology(shared.SentinelTopology):
    def __init__(
        self, workdir: Path, *, sentinels: int = 3, data_config: Sequence[str] = SENTINEL_DATA_CONFIG
    ) -> None:
        binary = require_binary("redis-server", REDIS_SERVER_HINT)
        super().__init__(workdir, sentinels=sentinels, data_config=data_config, binary=binary)
