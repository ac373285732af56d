"""The docs cite what the repo holds and list what the code does (docs/worker.md's settings: tests/worker)."""

from __future__ import annotations

import re
from pathlib import Path

from store.errors import MISS_REASONS

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", ROOT / "benchmarks" / "README.md", *(ROOT / "docs").glob("*.md")])


def test_docs_and_benchmarks_cite_nothing_outside_the_repo() -> None:
    """PLATFORM-NOTES was a file on the machines kvrq was built on; docs/platform.md holds its facts."""
    texts = [*DOCS, *(ROOT / "benchmarks").glob("*.py")]
    citing = [path.relative_to(ROOT) for path in texts if "PLATFORM-NOTES" in path.read_text()]
    assert citing == []


def test_repo_paths_named_in_the_docs_exist() -> None:
    named = {
        (doc.relative_to(ROOT), found)
        for doc in DOCS
        for found in re.findall(
            r"(?<![\w/.])((?:docs|benchmarks|engine|store|worker|producer|tests)/[\w/.-]*\w)", doc.read_text()
        )
    }
    missing = sorted((str(doc), path) for doc, path in named if not (ROOT / path).exists())
    assert missing == []


def test_every_miss_reason_is_in_the_store_format_table() -> None:
    documented = set(re.findall(r"`miss_(\w+)`", (ROOT / "docs" / "store-format.md").read_text()))
    assert documented == set(MISS_REASONS)
