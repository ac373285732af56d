"""Why a stored cache could not be used: every such case is a cache miss, never a crash."""

from __future__ import annotations

# Reasons a `get` is a miss. Each is a stats counter (`miss_<reason>`) and appears in the log.
ABSENT = "absent"  # nothing stored for the agent: an ordinary miss, not logged as a problem
SPEC_MISMATCH = "spec_mismatch"  # made by another model or ModelCacheSpec
FORMAT_VERSION = "format_version"  # written by another version of the store format
BAD_MANIFEST = "bad_manifest"  # manifest unreadable, truncated or failing its checksum
AGENT_MISMATCH = "agent_mismatch"  # manifest names another agent (a swapped file)
MISSING_BLOCK = "missing_block"  # a block the manifest lists is gone
TRUNCATED = "truncated"  # a block is shorter or longer than the manifest says
CHECKSUM = "checksum"  # a block's bytes do not match the manifest's CRC-32
BAD_BLOCK = "bad_block"  # a block parses badly or holds other shapes/dtypes than expected
BACKEND_ERROR = "backend_error"  # the disk or Redis call itself failed
NO_COMMON_PREFIX = "no_common_prefix"  # the cache shares no token with the prompt asked about
NAMESPACE_MISMATCH = "namespace_mismatch"  # stored by another namespace (tenant) than the get's
UNEXPECTED = "unexpected_error"  # a bug or an unforeseen failure: logged with its traceback

MISS_REASONS = (
    ABSENT,
    SPEC_MISMATCH,
    FORMAT_VERSION,
    BAD_MANIFEST,
    AGENT_MISMATCH,
    MISSING_BLOCK,
    TRUNCATED,
    CHECKSUM,
    BAD_BLOCK,
    BACKEND_ERROR,
    NO_COMMON_PREFIX,
    NAMESPACE_MISMATCH,
    UNEXPECTED,
)


# Reasons that mean the stored bytes are damaged (not merely foreign): such a cache is deleted.
DAMAGE = frozenset({BAD_MANIFEST, AGENT_MISMATCH, MISSING_BLOCK, TRUNCATED, CHECKSUM, BAD_BLOCK})


class StoreError(Exception):
    """A store operation failed (a put that could not be written, a bad store directory)."""


class BadCacheError(Exception):
    """A stored cache cannot be used; `reason` is one of MISS_REASONS."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.manifest_blob: bytes | bytearray | memoryview | None = None  # what was read, if any
