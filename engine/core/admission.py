"""Admission: the engine's answer to "can this request start?", pure Python so schedulers can use it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Verdict = Literal["now", "later", "never"]


@dataclass(frozen=True)
class Admission:
    """Now, later (it fits once running sequences end) or never (it cannot run here: see reason)."""

    verdict: Verdict
    reason: str = ""
