"""`chaos` tests (many rounds of kill -9, long outages, 1,000 fuzzed jobs: minutes) run only when
asked for with `-m chaos` (tests/store/conftest.py does the same for the store's)."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "chaos" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="many rounds of faults, minutes: select with -m chaos")
    for item in items:
        if item.get_closest_marker("chaos") is not None:
            item.add_marker(skip)
