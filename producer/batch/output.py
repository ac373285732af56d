"""The output JSONL file of a batch run: the durable record of which lines are finished.

Every finished line is appended and fsynced at once, so a crash or Ctrl-C loses nothing, and the next run
reads the file back to skip what is already there. An exclusive lock on the file keeps two clients from
writing the same output (which would duplicate lines); the OS drops it when the process dies.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from producer.batch.format import key_of_output


class OutputLockedError(RuntimeError):
    """Another process is writing this output file."""


class BatchOutput:
    """Append-only JSONL writer that knows the resume keys of the lines already written."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.keys: dict[str, bool] = {}  # resume key -> True for a response line, False for an error line
        self._file: IO[bytes] | None = None

    def open(self) -> BatchOutput:
        """Lock the file, drop a torn last line left by a crash, and load the keys already written."""
        if self.path.parent and not self.path.parent.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(self.path, "a+b")  # noqa: SIM115 - held open for the life of the run
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise OutputLockedError(f"{self.path} is being written by another kvrq batch client") from None
        self._file = handle
        self._load()
        return self

    def _load(self) -> None:
        assert self._file is not None
        self._file.seek(0)
        data = self._file.read()
        good_end = 0
        pos = 0
        while pos < len(data):
            end = data.find(b"\n", pos)
            if end < 0:
                break  # no newline: a write torn by a crash
            raw = data[pos:end]
            pos = end + 1
            if raw.strip():
                try:
                    record = json.loads(raw)
                except json.JSONDecodeError:
                    record = None
                if isinstance(record, dict):
                    self._count(record)
            good_end = pos
        if good_end < len(data):
            self._file.truncate(good_end)
            os.fsync(self._file.fileno())

    def _count(self, record: Mapping[str, Any]) -> None:
        key = key_of_output(record)
        if key is not None and key not in self.keys:
            self.keys[key] = not record.get("error")

    def __contains__(self, key: object) -> bool:
        return key in self.keys

    def append(self, key: str, record: Mapping[str, Any]) -> None:
        """Write one line durably; a key already written is skipped (each custom_id exactly once)."""
        if self._file is None:
            raise RuntimeError("BatchOutput is not open")
        if key in self.keys:
            return
        self._file.seek(0, os.SEEK_END)
        self._file.write(json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode() + b"\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self.keys[key] = not record.get("error")

    def close(self) -> None:
        if self._file is not None:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            self._file.close()
            self._file = None

    def __enter__(self) -> BatchOutput:
        return self.open()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
