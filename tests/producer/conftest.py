"""tests/producer's `producer` fixture: a test that takes it runs on Producer, then on AsyncProducer."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from producer.client import Producer
from tests.producer.clients import AsyncView, async_producer
from tests.producer.fakes import fake_redis


@pytest.fixture(params=["sync", "async"])
def producer(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A Producer, or an AsyncProducer seen through AsyncView, over one fakeredis server."""
    blocking = fake_redis()
    if request.param == "sync":
        yield Producer(connection=blocking)
        return
    with asyncio.Runner() as runner:
        yield AsyncView(runner, async_producer(blocking))
