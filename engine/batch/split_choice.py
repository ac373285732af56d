"""SplitChoice: per decode step shape, whether the CPU shortcuts' split (numpy's exp and the C
attention, a sync per layer: engine/cpu/shortcuts.py) or MLX's fused calls run faster here and now,
learnt from the steps themselves.

Why: which wins depends on the machine and its load. On the quiet 2-core dev machine the split won
from 8 rows up (the fixed thresholds in engine/cpu/shortcuts.py); beside other work each sync waits
for both cores to be scheduled again, and 16 short rows decoding took 6-23% more CPU time per token
with the split than fused (5 of 5 rounds; issue 43, 2026-11-27, load 8-13; wall time: either way).
A fixed threshold is right for one of the two. So the split stays the default
where the thresholds say so; after EXPLORE_AFTER decode steps of a shape, fused steps are tried
(every other step until both have MIN_SAMPLES), then the faster median runs and the other is re-tried
one step in EXPLORE_EVERY. Only decode steps without drafts or prompt tokens are timed or switched:
their cost is the shape's alone. Where nothing is split (Metal, CUDA, KVRQ_CPU_SHORTCUTS=0, small
steps) there is nothing to choose.
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Any

#: Decode steps of one shape run as the thresholds say before the other way is tried.
EXPLORE_AFTER = 16
#: Then the way not chosen runs one step in this many (the load changes).
EXPLORE_EVERY = 32
#: Times of each way needed before choosing, and kept (their median counts).
MIN_SAMPLES = 3
SAMPLES = 9

Key = tuple[int, int]  # (query tokens, bit length of the step's attention scores a head and layer)


class SplitChoice:
    def __init__(self) -> None:
        self._steps: dict[Key, int] = {}
        self._times: dict[tuple[Key, bool], deque[float]] = {}
        self.fused_steps = 0  # steps this chose to run fused where the thresholds said split

    def pick(self, key: Key, split: Any, fused: Any) -> tuple[Any, bool | None]:
        """The shortcuts a decode step of shape `key` runs with, and whether they are the split (None:
        nothing to choose, `split` has no split)."""
        if fused == split:
            return split, None
        n = self._steps[key] = self._steps.get(key, 0) + 1
        if n <= EXPLORE_AFTER:
            return split, True
        split_s, fused_s = self.median(key, True), self.median(key, False)
        if split_s is None or fused_s is None:
            use_split = n % 2 == 0 if fused_s is None else True
        else:
            use_split = split_s <= fused_s
            if n % EXPLORE_EVERY == 0:
                use_split = not use_split
        if not use_split:
            self.fused_steps += 1
        return (split, True) if use_split else (fused, False)

    def record(self, key: Key, split: bool, seconds: float) -> None:
        times = self._times.setdefault((key, split), deque(maxlen=SAMPLES))
        times.append(seconds)

    def median(self, key: Key, split: bool) -> float | None:
        times = self._times.get((key, split))
        return statistics.median(times) if times is not None and len(times) >= MIN_SAMPLES else None
