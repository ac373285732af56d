"""ShortSlots: short decoding rows side by side in one K and one V buffer per layer.

Why: with every row in its own buffers, a decode step ran ~10 small MLX ops per row and
layer (write the new token, slice, pad, concatenate for the batched attention): at 16
rows that made a step ~20% slower than mlx-lm's BatchGenerator. Here a step writes all
short rows' new K/V with one scatter per layer and attends over the buffers in place.

Layout, per layer: K as (slots * kv_heads, capacity, k_dim), V likewise; the row in slot
s owns lines s*heads .. (s+1)*heads (a reshape to (slots, heads, capacity, dim), a view,
is what attention reads). Guarantees:
- slots are dense: the rows in them are slots 0..n-1 in `rows` order, so the first n
  tokens of a step's flat batch are theirs; a row leaving makes room by moving the last
  row into its slot (one copy of at most SHORT_ROW_TOKENS tokens);
- a slotted row has no buffers of its own (its KVCaches' keys/values are None): `enter`
  drops them, `leave` writes its K/V into new ones before anybody reads them (the cut of
  a finished row, or a row grown past SHORT_ROW_TOKENS). So a row's KV is held once, and
  the buffers `leave` makes come out of MLX's cache of the ones `enter` dropped;
- capacity grows in SLOT_CAPACITY_STEP tokens up to SHORT_ROW_TOKENS and slots double;
  growing copies the buffers once; the buffers are freed when the last row leaves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from engine.batch.attention import AttentionCall
from engine.kv.buffers import round_up

# Decoding rows up to this many tokens (after the step's token) go into the slots; longer
# rows attend alone over their own buffers and pad nobody.
SHORT_ROW_TOKENS = 512
SLOT_CAPACITY_STEP = 128
KV_GROWTH_TOKENS = 256  # a row's own buffers grow in these steps, as mlx-lm's KVCache does


@dataclass(frozen=True)
class SlotStep:
    """One step's view of the slots, the same for every layer."""

    size: int  # rows in the slots: the first `size` tokens of the flat batch
    width: int  # positions attended: the longest slotted row after this step's token
    mask: mx.array | None  # (size, 1, 1, width): True where a row has a token; None: all rows full
    lines: mx.array  # (size * heads,): buffer line of each new head vector
    positions: mx.array  # (size * heads,): the position it is written to
    lengths: tuple[int, ...]  # each slotted row's tokens after this step's


class ShortSlots:
    def __init__(self) -> None:
        self.keys: list[mx.array] = []  # per layer, (slots * heads, capacity, k_dim)
        self.values: list[mx.array] = []
        self.rows: list[Any] = []  # the slotted rows (ragged.Row), slot order
        self.heads = 0
        self.slots = 0
        self.capacity = 0
        self._layer_shapes: list[tuple[int, int, mx.Dtype]] = []  # per layer: k_dim, v_dim, dtype

    def __contains__(self, row: Any) -> bool:
        return any(slotted is row for slotted in self.rows)

    def enter(self, row: Any) -> None:
        """Copy a decoding row's K/V (all of its `length` tokens) into the next free slot."""
        length = row.length
        if length + 1 > SHORT_ROW_TOKENS:
            raise ValueError(f"a row of {length} tokens is not short")
        if not self.rows:
            self.heads = int(row.layers[0].keys.shape[1])
            self._layer_shapes = [
                (int(layer.keys.shape[3]), int(layer.values.shape[3]), layer.keys.dtype)
                for layer in row.layers
            ]
        self._grow(len(self.rows) + 1, length + 1)
        lines = self._lines(len(self.rows))
        for layer, keys, values in zip(row.layers, self.keys, self.values, strict=True):
            keys[lines, :length, :] = layer.keys[0, :, :length, :]
            values[lines, :length, :] = layer.values[0, :, :length, :]
        # The copies above hold the row's buffers until the step evaluates them; then they go.
        for layer in row.layers:
            layer.keys = layer.values = None
        self.rows.append(row)

    def leave(self, row: Any) -> None:
        """Write the row's K/V back into its own buffers and free its slot."""
        slot = next(i for i, slotted in enumerate(self.rows) if slotted is row)
        length = row.length
        lines = self._lines(slot)
        capacity = round_up(length, KV_GROWTH_TOKENS)
        for layer, keys, values, (k_dim, v_dim, dtype) in zip(
            row.layers, self.keys, self.values, self._layer_shapes, strict=True
        ):
            layer.keys = mx.zeros((1, self.heads, capacity, k_dim), dtype=dtype)
            layer.values = mx.zeros((1, self.heads, capacity, v_dim), dtype=dtype)
            layer.keys[..., :length, :] = keys[lines, :length, :][None]
            layer.values[..., :length, :] = values[lines, :length, :][None]
            layer.offset = length
        last = len(self.rows) - 1
        if slot != last:
            moved = self.rows[last]
            from_lines, n = self._lines(last), moved.length
            for keys, values in zip(self.keys, self.values, strict=True):
                keys[lines, :n, :] = keys[from_lines, :n, :]
                values[lines, :n, :] = values[from_lines, :n, :]
            self.rows[slot] = moved
        self.rows.pop()
        # Evaluated now so that the next step's scatter finds the buffers unshared (in place).
        mx.eval(self.keys, self.values, [(layer.keys, layer.values) for layer in row.layers])
        if not self.rows:
            self.clear()

    def prepare_step(self) -> SlotStep | None:
        """Room for one more token in every slotted row, and the step's indices and mask."""
        if not self.rows:
            return None
        lengths = [row.length for row in self.rows]
        width = max(lengths) + 1
        self._grow(len(self.rows), width)
        size, heads = len(self.rows), self.heads
        mask = None  # rows of one length (a single row, say) read no padding: no masking pass
        if min(lengths) + 1 < width:
            sizes = mx.array(lengths) + 1
            mask = (mx.arange(width)[None, :] < sizes[:, None])[:, None, None, :]
        return SlotStep(
            size=size,
            width=width,
            mask=mask,
            lines=mx.arange(size * heads),
            positions=mx.repeat(mx.array(lengths), heads),
            lengths=tuple(n + 1 for n in lengths),
        )

    def write(self, layer: int, step: SlotStep, keys: mx.array, values: mx.array) -> None:
        """Store the step's new K/V of the slotted rows: (size, heads, 1, dim) each."""
        self.keys[layer][step.lines, step.positions] = keys.reshape(step.size * self.heads, -1)
        self.values[layer][step.lines, step.positions] = values.reshape(step.size * self.heads, -1)

    def attention_call(self, layer: int, step: SlotStep, queries: mx.array) -> AttentionCall:
        """The slotted rows' attention over the buffers in place: (size, heads, width, dim) views."""
        keys, values = self.keys[layer], self.values[layer]
        shape = (self.slots, self.heads, self.capacity)
        k = keys.reshape(*shape, -1)[: step.size, :, : step.width]
        v = values.reshape(*shape, -1)[: step.size, :, : step.width]
        return AttentionCall(queries, k, v, mask=step.mask, prefix_lengths=step.lengths)

    def clear(self) -> None:
        """Free the buffers (the rows in them, if any, are dropped with their K/V)."""
        self.keys, self.values, self.rows = [], [], []
        self.slots = self.capacity = 0

    def _lines(self, slot: int) -> slice:
        return slice(slot * self.heads, (slot + 1) * self.heads)

    def _grow(self, slots: int, tokens: int) -> None:
        if slots <= self.slots and tokens <= self.capacity:
            return
        new_slots = max(self.slots, 4)
        while new_slots < slots:
            new_slots *= 2
        new_capacity = max(self.capacity, min(round_up(tokens, SLOT_CAPACITY_STEP), SHORT_ROW_TOKENS))
        old_lines, lines = self.slots * self.heads, new_slots * self.heads
        grown_keys, grown_values = [], []
        for i, (k_dim, v_dim, dtype) in enumerate(self._layer_shapes):
            keys = mx.zeros((lines, new_capacity, k_dim), dtype=dtype)
            values = mx.zeros((lines, new_capacity, v_dim), dtype=dtype)
            if self.keys:
                keys[:old_lines, : self.capacity, :] = self.keys[i]
                values[:old_lines, : self.capacity, :] = self.values[i]
            grown_keys.append(keys)
            grown_values.append(values)
        mx.eval(grown_keys, grown_values)
        self.keys, self.values = grown_keys, grown_values
        self.slots, self.capacity = new_slots, new_capacity
