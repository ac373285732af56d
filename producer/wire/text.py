"""Redis answers as str: redis-py hands back bytes unless a client decodes, and kvrq uses both."""

from __future__ import annotations

from typing import overload


@overload
def as_text(value: bytes | str) -> str: ...
@overload
def as_text(value: bytes | str | None) -> str | None: ...
def as_text(value: bytes | str | None) -> str | None:
    """`value` decoded as UTF-8 when it is bytes; str and None come back as they are."""
    return value.decode("utf-8") if isinstance(value, bytes) else value
