"""rq's Job with a bound on its data: the arguments a worker will decompress and parse as JSON.

rq stores a job's arguments zlib-compressed and decompresses them whole when it loads the job,
before any kvrq check runs: 1 MB in Redis can hold 1 GB of repeated text. `BoundedJob` looks at
the size first and decompresses at most `MAX_JOB_DATA_BYTES`; an oversized job loads with empty
data and `data_problem` set, and the worker fails it with that reason (worker.jobs). Its payload
stays in Redis as it was: the empty stand-in is never written back.
"""

from __future__ import annotations

import zlib
from typing import Any

from rq.job import Job

from producer.models import MAX_PROMPT_CHARS

MiB = 1024 * 1024
#: Decompressed job data (the JSON of the call) a kvrq worker loads. The largest valid request is
#: under 13 MB: a MAX_PROMPT_CHARS prompt (or messages) of astral characters escaped as JSON
#: (12 bytes each), 64 KB of metadata and 16 stop strings; so a valid request always fits.
MAX_JOB_DATA_BYTES = 16 * MiB


def data_size_problem(raw: bytes, limit: int = MAX_JOB_DATA_BYTES) -> str | None:
    """Why the stored job data `raw` (zlib or plain, as rq reads it) is too large, or None."""
    return inflate(raw, limit)[1]


def inflate(raw: bytes, limit: int = MAX_JOB_DATA_BYTES) -> tuple[bytes, str | None]:
    """The job data rq would load from `raw` and None, or b"" and why it is over `limit` bytes."""
    if len(raw) > limit:
        return b"", _too_large(f"{len(raw):,} bytes stored", limit)
    inflater = zlib.decompressobj()
    try:
        data = inflater.decompress(raw, limit + 1)
    except zlib.error:
        return raw, None  # rq falls back to uncompressed data, already checked above
    if len(data) > limit or inflater.unconsumed_tail:
        return b"", _too_large(f"over {limit:,} bytes", limit)
    return data, None


def _too_large(size: str, limit: int) -> str:
    return (
        f"the job's data (its arguments as JSON) is {size}; a kvrq worker loads at most {limit:,} "
        f"bytes (a request's prompt or messages hold at most {MAX_PROMPT_CHARS:,} characters)"
    )


class BoundedJob(Job):
    """A Job that refuses to decompress oversized data; `data_problem` says why, None when loaded."""

    data_problem: str | None = None

    def restore(self, raw_data: Any) -> Any:
        key = b"data" if b"data" in raw_data else "data"
        stored = raw_data.get(key)
        data, problem = inflate(stored if isinstance(stored, bytes) else str(stored or "").encode())
        result = super().restore({**raw_data, key: b""})  # rq's own unbounded inflate sees nothing
        self.data_problem = problem
        if problem is None:
            self.data = data
        return result

    def to_dict(self, include_meta: bool = True, include_result: bool = True) -> dict[Any, Any]:
        obj = super().to_dict(include_meta=include_meta, include_result=include_result)
        if self.data_problem is not None:
            obj.pop("data", None)  # keep the stored payload as it was
        return obj
