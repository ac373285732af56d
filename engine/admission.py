"""Admission: the engine's answer to "can this request start?", pure Python so schedulers can use it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Verdict = Literal["now", "later", "never"]


@dataclass(frozen=True)
class Admission:
    """ "now"; "later": it fits once running sequences end; "never": it can never run here (the reason says why)."""

    verdict: Verdict
    reason: str = ""
