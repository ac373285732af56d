"""A child process for the crash tests: puts large caches of one agent in a loop until it is killed.

Run as `python -m tests.store.crash_writer KIND LOCATION`. It prints `ready` once its
store is open, then puts the versions of `crash_versions()` round and round through the
hot tier's write-behind thread (waiting for each put's future), so a `kill -9` lands
inside a backend write almost every time.
"""

from __future__ import annotations

import itertools
import sys

from engine.core.spec import ModelCacheSpec
from store.backend import BlockBackend
from store.disk import DiskStore
from store.hot import HotTierStore
from store.redis_store import RedisStore
from tests.store.conftest import make_cache, tiny_spec, tokens

AGENT = "crash-agent"
REDIS_PREFIX = "crash:"


def crash_spec() -> ModelCacheSpec:
    """8 layers x 2 heads x 64 dims float32: 8 KB per token, so a put writes megabytes."""
    return tiny_spec(layers=8)


def crash_versions() -> list[list[int]]:
    """Token lists sharing prefixes of several lengths (puts reuse some blocks and rewrite others),
    each of a different length, so a cache made of parts of two versions cannot pass as either."""
    base = tokens(2400, seed=1)
    return [base[: 900 + 200 * i] + tokens(300 + 17 * i, seed=100 + i) for i in range(4)]


def open_crash_backend(kind: str, location: str) -> BlockBackend:
    """The backend under test; in Redis each 64 KB block is cut into 16 KB values, so kills also
    land between the values of one block."""
    if kind == "disk":
        return DiskStore(location, crash_spec())
    return RedisStore(location, crash_spec(), prefix=REDIS_PREFIX, value_bytes=16_384)


def main(argv: list[str]) -> None:
    kind, location = argv
    backend = open_crash_backend(kind, location)
    caches = [make_cache(backend.spec, version) for version in crash_versions()]
    store = HotTierStore(backend, 0)
    print("ready", flush=True)
    for cache in itertools.cycle(caches):
        store.put(AGENT, cache).result()


if __name__ == "__main__":
    main(sys.argv[1:])
