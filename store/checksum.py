"""CRC-32 of stored bytes: python-isal's when installed (same polynomial as zlib, ~5x faster here).

Every block is checksummed once when written and once when read. On a 2-core machine that
shares its cores with Redis itself, zlib's CRC-32 (2-4 GB/s) was what kept a Redis get or put
below raw GET/SET speed; ISA-L's runs at memory speed (~18 GB/s measured here). The values
are identical, so stores written with either read with either.
"""

from __future__ import annotations

from collections.abc import Callable

try:
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # not installed: zlib gives the same checksums, slower
    from zlib import crc32 as _crc32

crc32: Callable[..., int] = _crc32
