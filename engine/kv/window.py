"""WindowKVCache: one ragged row's K/V for a sliding-window layer, in token order.

Why not mlx-lm's RotatingKVCache: the ragged step (engine/batch/ragged.py) attends per row over a
slice of the row's own buffer; a rotating buffer holds its tokens out of order once it wraps, so
every step would need a gather. Here the buffer holds positions `first .. offset-1` in order; a
run of tokens at positions s..s+n-1 attends to the keys from s - window + 1 on (each token to
the last `window` positions, itself included: what mlx-lm's sliding masks give), and when the
buffer is full the last `window - 1` tokens move to its front (one copy every ~256 tokens), so
a long row never holds much more than its window.

A row whose layers all start at position 0 (`first == 0`) may sit in the ShortSlots, which hold
every token of a short row; it then has no buffers of its own, like a plain KVCache.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

GROWTH_TOKENS = 256  # the buffer grows (and keeps this much headroom past the window) in these steps


class WindowKVCache:
    def __init__(self, window: int) -> None:
        if window <= 0:
            raise ValueError(f"a sliding window must be positive, got {window}")
        self.window = window
        self.keys: mx.array | None = None  # (1, heads, capacity, k_dim): positions first.. in order
        self.values: mx.array | None = None
        self.first = 0  # position of the buffer's first token
        self.offset = 0  # tokens seen: the next token's position
        self._mask: mx.array | str | None = None  # the last run's mask (see mask())

    @classmethod
    def from_rotating(cls, cache: Any) -> WindowKVCache:
        """The same tokens as a RotatingKVCache that never wrapped (one rebuilt from blocks:
        engine/kv/layered.py gives the window's tokens in order, `_idx` = their count)."""
        out = cls(int(cache.max_size))
        if cache.keys is not None and int(cache.offset) > 0:
            held = int(cache._idx)
            if held not in (int(cache.keys.shape[2]), int(cache.offset)):
                raise ValueError("only a RotatingKVCache holding its tokens in order can become a row's")
            out.keys, out.values = cache.keys, cache.values
            out.offset = int(cache.offset)
            out.first = out.offset - held
        return out

    @property
    def held(self) -> int:
        return self.offset - self.first

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append a run of (1, heads, n, dim) K/V; give back the K/V that run attends to."""
        n = int(keys.shape[2])
        start = self.offset
        self._make_room(keys, values, n)
        assert self.keys is not None and self.values is not None
        at = self.held
        self.keys[..., at : at + n, :] = keys
        self.values[..., at : at + n, :] = values
        self.offset += n
        key_start = max(self.first, start - self.window + 1)
        before = start - key_start  # keys of earlier tokens the run sees
        if n == 1:
            self._mask = None
        elif before + n <= self.window:
            self._mask = "causal"
        else:
            self._mask = create_causal_mask(n, before, window_size=self.window)
        lo, hi = key_start - self.first, self.held
        return self.keys[..., lo:hi, :], self.values[..., lo:hi, :]

    def trim(self, n: int) -> int:
        """Drop the last n tokens (a drafted step's rejected positions: engine/batch/speculation.py); they
        are the newest run's, so the window before them is still held. Gives back how many it dropped."""
        n = min(self.held, n)
        self.offset -= n
        return n

    def mask(self) -> mx.array | str | None:
        """The last run's mask over the keys update_and_fetch gave: None for one token, "causal"
        where no token's window cuts the keys, else a boolean (n, keys) causal-window mask."""
        return self._mask

    def _make_room(self, keys: mx.array, values: mx.array, n: int) -> None:
        capacity = 0 if self.keys is None else int(self.keys.shape[2])
        if self.held + n <= capacity:
            return
        keep = min(self.held, self.window - 1)  # what later tokens may still attend to
        new_capacity = max(capacity, -(-(keep + n + GROWTH_TOKENS) // GROWTH_TOKENS) * GROWTH_TOKENS)
        shape = (1, int(keys.shape[1]), new_capacity)
        new_keys = mx.zeros((*shape, int(keys.shape[3])), dtype=keys.dtype)
        new_values = mx.zeros((*shape, int(values.shape[3])), dtype=values.dtype)
        if self.keys is not None and self.values is not None and keep:
            held = self.held
            new_keys[..., :keep, :] = self.keys[..., held - keep : held, :]
            new_values[..., :keep, :] = self.values[..., held - keep : held, :]
        self.keys, self.values = new_keys, new_values
        self.first = self.offset - keep

    def ordered(self) -> tuple[mx.array, mx.array, int]:
        """(keys, values, position of their first token) of every token held, in order."""
        if self.keys is None or self.values is None:
            raise RuntimeError("an empty window cache for a sequence that has tokens")
        return self.keys[..., : self.held, :], self.values[..., : self.held, :], self.first
