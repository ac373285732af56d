"""store.checksum.crc32: ISA-L's CRC-32 where installed, equal to zlib's, so stores stay interchangeable."""

from __future__ import annotations

import importlib
import sys
import zlib

import numpy as np
import pytest

from store import checksum


@pytest.mark.parametrize("size", [0, 1, 7, 4096, 1_000_003])
def test_equal_to_zlib_on_bytes_views_and_arrays(size: int) -> None:
    data = np.random.default_rng(size).integers(0, 256, size=size, dtype=np.uint8)
    expected = zlib.crc32(data.tobytes())
    for value in (data.tobytes(), data.data, data, bytearray(data.tobytes())):
        assert checksum.crc32(value) == expected
    assert checksum.crc32(b"tail", checksum.crc32(data)) == zlib.crc32(data.tobytes() + b"tail")


def test_falls_back_to_zlib_without_isal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "isal", None)  # as if not installed: importing it fails
    monkeypatch.setitem(sys.modules, "isal.isal_zlib", None)
    try:
        reloaded = importlib.reload(checksum)
        assert reloaded.crc32 is zlib.crc32
    finally:
        monkeypatch.undo()
        importlib.reload(checksum)


def test_isal_is_what_the_worker_extra_installs() -> None:
    """The fast path is the one benchmarked: pyproject's worker extra pulls python-isal."""
    pytest.importorskip("isal", reason="python-isal is not installed (pip install -e '.[worker]')")
    assert checksum.crc32 is not zlib.crc32
