"""SSM / linear-attention layers in the ragged step: each row keeps its own state (an ArraysCache).

Why: the ragged step lays every row's tokens out as one flat (tokens, 1) batch (engine/batch/ragged.py),
which suits attention (each token carries its position, attention is routed per row) but not a
recurrence: a row's tokens must run through its state in order. So the mixer of a state layer (the
module that reads and writes the ArraysCache) gets a FlatStateCache, and the mixer's class is routed
(route_state_mixers) to run it per row: every decoding row whose state exists in ONE batched call (the
rows' states stacked along the batch axis, then split back), every prompt run as its own (1, n) call
with its row's cache. Nobody is padded; the projections of the rest of the layer still run once over
the flat batch. Masks: the model asks the cache (make_mask) and gets None, as a batch without padding needs.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

import mlx.core as mx

# Per verified module, the classes whose __call__ takes the layer's ArraysCache (mlx-lm 0.32).
STATE_MIXERS: dict[str, tuple[str, ...]] = {
    "mlx_lm.models.mamba": ("MambaBlock",),
    "mlx_lm.models.mamba2": ("Mamba2Block",),
    "mlx_lm.models.qwen3_next": ("Qwen3NextGatedDeltaNet",),
    "mlx_lm.models.qwen3_5": ("GatedDeltaNet",),
    "mlx_lm.models.falcon_h1": ("FalconH1Mixer",),
}


class FlatStateCache:
    """One state layer's view of a step: the rows' caches and their run lengths, in the flat batch's
    order (the first `skip` tokens belong to nobody here: there are no ShortSlots with state layers),
    and `padding` trailing rows that belong to nobody."""

    def __init__(self, rows: list[Any], run_lengths: list[int], padding: int) -> None:
        self.rows = rows
        self.run_lengths = run_lengths
        self.padding = padding

    def make_mask(self, *args: Any, **kwargs: Any) -> None:
        return None  # each row runs alone (or with rows of one token): no padding to mask

    def run(self, call: Callable[[mx.array, Any], mx.array], x: mx.array) -> mx.array:
        """The mixer's output for the flat batch `x` (tokens, 1, dim): `call(x_part, cache)` per row,
        decoding rows with a state batched into one call."""
        used = x.shape[0] - self.padding
        bounds, total = [], 0
        for n in self.run_lengths[:-1]:
            total += n
            bounds.append(total)
        parts: list[mx.array] = mx.split(x[:used], bounds, axis=0) if bounds else [x[:used]]  # type: ignore[assignment]
        outputs: list[mx.array | None] = [None] * len(parts)
        batched = [
            i
            for i, (row, n) in enumerate(zip(self.rows, self.run_lengths, strict=True))
            if n == 1 and all(a is not None for a in row.cache)
        ]
        if len(batched) > 1:
            self._run_batched(call, parts, batched, outputs)
        for i, (part, row) in enumerate(zip(parts, self.rows, strict=True)):
            if outputs[i] is None:
                outputs[i] = call(part.swapaxes(0, 1), row).swapaxes(0, 1)  # (1, n, dim) -> (n, 1, out)
        done = [o for o in outputs if o is not None]
        if self.padding:
            done.append(mx.zeros((self.padding, *done[0].shape[1:]), dtype=done[0].dtype))
        return mx.concatenate(done, axis=0) if len(done) > 1 else done[0]

    def _run_batched(
        self,
        call: Callable[[mx.array, Any], mx.array],
        parts: list[mx.array],
        batched: list[int],
        outputs: list[mx.array | None],
    ) -> None:
        from mlx_lm.models.cache import ArraysCache

        caches = [self.rows[i] for i in batched]
        batch: Any = ArraysCache(size=len(caches[0].cache))
        batch.cache = [mx.concatenate([c.cache[k] for c in caches], axis=0) for k in range(len(batch.cache))]
        out = call(mx.concatenate([parts[i] for i in batched], axis=0), batch)  # (rows, 1, out)
        for j, (i, cache) in enumerate(zip(batched, caches, strict=True)):
            outputs[i] = out[j : j + 1]
            cache.cache = [array[j : j + 1] for array in batch.cache]


class FlatCacheList:
    """A CacheList layer's view of a step (falcon_h1: SSM state and KV in one layer): its members'
    flat views, indexed as the model indexes the CacheList."""

    def __init__(self, members: list[Any]) -> None:
        self.caches = members

    def __getitem__(self, index: int) -> Any:
        return self.caches[index]


def route_state_mixers(module_name: str) -> None:
    """Make the module's state mixers run a FlatStateCache per row (once per class); any other cache
    goes to mlx-lm's own __call__ unchanged."""
    module: Any = sys.modules[module_name]
    for class_name in STATE_MIXERS.get(module_name, ()):
        cls = getattr(module, class_name)
        original = cls.__call__
        if getattr(original, "_kvrq_routed", False):
            continue
        routed = _per_row(original)
        routed._kvrq_routed = True  # type: ignore[attr-defined]
        cls.__call__ = routed


def _per_row(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
    """`original` (self, input, ...) run per row where one of its arguments is a FlatStateCache; the
    input may come by keyword (falcon_h1 passes `input_states=`)."""
    input_name = list(inspect.signature(original).parameters)[1]

    @functools.wraps(original)
    def call(self: Any, *args: Any, **kwargs: Any) -> mx.array:
        flat = next((a for a in (*args, *kwargs.values()) if isinstance(a, FlatStateCache)), None)
        if flat is None:
            return original(self, *args, **kwargs)
        by_name = not args
        x = kwargs.pop(input_name) if by_name else args[0]
        rest = args[1:]

        def one(part: mx.array, cache: Any) -> mx.array:
            row_args = [cache if a is flat else a for a in rest]
            row_kwargs = {k: cache if v is flat else v for k, v in kwargs.items()}
            if by_name:
                return original(self, *row_args, **{input_name: part, **row_kwargs})
            return original(self, part, *row_args, **row_kwargs)

        return flat.run(one, x)

    return call
