"""BlockSlab: host memory for extracted blocks that is recycled instead of freed.

Fresh memory costs a page fault per 4 KiB page, which on this CPU makes copying into a
new array two to eight times slower than copying into warm memory. Extracted blocks
therefore live in slots (one buffer of one block's bytes each) that are handed out
again once nothing refers to them any more: a block's arrays are numpy views of their
slot, and every numpy view keeps its memory's owner alive, so a slot whose owner is
referenced only by the slab itself is provably unused (the store, a hot tier or a test
still holding a block keeps its slot lent).
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass

import numpy as np

from engine.kv.fast_copy import PAGE, page_offset_array


@dataclass
class _Slot:
    data: np.ndarray  # bytes_per_block bytes, half a page past a page boundary
    owner: np.ndarray  # the allocation `data` (and every view of it) points into
    idle_refs: int  # sys.getrefcount(owner) while nothing but the slab refers to it


class BlockSlab:
    def __init__(self, bytes_per_block: int, max_idle_slots: int) -> None:
        if bytes_per_block <= 0:
            raise ValueError(f"bytes_per_block must be positive, got {bytes_per_block}")
        self.bytes_per_block = bytes_per_block
        self.max_idle_slots = max(0, max_idle_slots)
        self._lent: list[_Slot] = []
        self._idle: list[_Slot] = []
        self._lock = threading.Lock()

    @property
    def lent_slots(self) -> int:
        return len(self._lent)

    @property
    def idle_slots(self) -> int:
        return len(self._idle)

    def take(self, n_slots: int) -> list[np.ndarray]:
        """n flat uint8 buffers of bytes_per_block each: recycled where possible, new otherwise."""
        with self._lock:
            if len(self._idle) < n_slots:
                self._reclaim()
            slots = [self._idle.pop() for _ in range(min(n_slots, len(self._idle)))]
            slots += [self._new_slot() for _ in range(n_slots - len(slots))]
            self._lent.extend(slots)
            return [slot.data[:] for slot in slots]  # fresh views: each holds its owner

    def reclaim(self) -> None:
        """Take back every slot nothing refers to any more (take() does this when it runs short)."""
        with self._lock:
            self._reclaim()

    def _new_slot(self) -> _Slot:
        # Half a page away from where MLX and numpy buffers start, so copies between them
        # and a slot never hit 4K aliasing (engine/kv/fast_copy.py).
        data = page_offset_array(self.bytes_per_block, PAGE // 2)
        owner = data.base
        assert isinstance(owner, np.ndarray)
        slot = _Slot(data, owner, 0)
        slot.idle_refs = sys.getrefcount(slot.owner) - 1  # less this function's local name
        return slot

    def _reclaim(self) -> None:
        still_lent: list[_Slot] = []
        for slot in self._lent:
            if sys.getrefcount(slot.owner) <= slot.idle_refs:
                if len(self._idle) < self.max_idle_slots:
                    self._idle.append(slot)
            else:
                still_lent.append(slot)
        self._lent = still_lent
