"""tests/conftest.py's rules: CI never skips for a missing tool; `-m "not slow"` never loads the model."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import deselect_chaos, reject_unmarked_real_model_tests, require_binary


def test_a_missing_tool_skips_locally_and_fails_under_ci(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no redis-server
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no redis-server on PATH"):
        require_binary("redis-server", "apt-get install redis-server")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI runs .ci/setup"):
        require_binary("redis-server", "apt-get install redis-server")


def test_a_present_tool_is_found_under_ci(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    tool = tmp_path / "redis-server"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("CI", "true")
    assert require_binary("redis-server", "hint") == str(tool)


@dataclass
class FakeItem:
    nodeid: str
    fixturenames: list[str]
    markers: set[str] = field(default_factory=set)

    def get_closest_marker(self, name: str) -> object | None:
        return name if name in self.markers else None


def test_a_test_using_the_real_model_must_be_marked_slow() -> None:
    fine = [FakeItem("a", ["smollm2"], {"slow"}), FakeItem("b", ["tmp_path"])]
    reject_unmarked_real_model_tests(fine)  # type: ignore[arg-type]
    with pytest.raises(pytest.UsageError, match="not marked slow: c"):
        reject_unmarked_real_model_tests([*fine, FakeItem("c", ["engine", "smollm2"])])  # type: ignore[list-item]


class FakeConfig:
    def __init__(self, markexpr: str) -> None:
        self.markexpr = markexpr
        self.deselected: list[object] = []
        self.hook = self

    def getoption(self, name: str) -> str:
        assert name == "markexpr"
        return self.markexpr

    def pytest_deselected(self, items: list[object]) -> None:
        self.deselected += items


def test_chaos_tests_run_only_when_asked_for() -> None:
    quick, chaos = FakeItem("quick", []), FakeItem("loop", [], {"chaos"})
    items = [quick, chaos]
    config = FakeConfig("")
    deselect_chaos(config, items)  # type: ignore[arg-type]
    assert items == [quick] and config.deselected == [chaos]
    items = [quick, chaos]
    deselect_chaos(FakeConfig("chaos"), items)  # type: ignore[arg-type]
    assert items == [quick, chaos]
