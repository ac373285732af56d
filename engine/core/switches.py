"""kvrq's environment switches, read one way: every `KVRQ_*` on/off variable takes the same values.

Why: the switches grew one at a time and each read its variable its own way (one took any
non-empty value as "off", even "0"; others only "0"). A user who sets one must be able to
predict what it does, and a typo must say so instead of silently meaning "on" or "off".
The table of every switch is in docs/worker.md ("Environment switches").
"""

from __future__ import annotations

import os
from collections.abc import Mapping

TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off"})


class SwitchError(ValueError):
    """A KVRQ_* variable holds a value its switch does not take."""


def switch(variable: str, default: bool = True, environ: Mapping[str, str] | None = None) -> bool:
    """The on/off value of `variable` in `environ` (default: os.environ): 1/true/yes/on or
    0/false/no/off (any case); unset or empty: `default`; anything else: SwitchError."""
    environ = os.environ if environ is None else environ
    value = environ.get(variable, "").strip().lower()
    if not value:
        return default
    if value in TRUE_WORDS:
        return True
    if value in FALSE_WORDS:
        return False
    raise SwitchError(f"{variable}={environ[variable]!r}: use 1/true/yes/on or 0/false/no/off")


def count(variable: str, default: int = 0) -> int:
    """The non-negative integer in `variable`; unset or empty: `default`; else SwitchError."""
    value = os.environ.get(variable, "").strip()
    if not value:
        return default
    if not value.isdigit():
        raise SwitchError(f"{variable}={value!r}: use a whole number (0 = automatic)")
    return int(value)
