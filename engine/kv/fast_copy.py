"""copy_array: np.copyto that sidesteps 4K aliasing.

A forward memcpy whose destination lies 1 to 63 bytes past its source modulo 4096
stalls on every load (the CPU takes the load for a possible reload of a just-stored
address): measured here 15-40x slower than the same copy at another offset. MLX's
buffers, numpy's and the store's decoded arrays all start a few bytes past a page, so
this is the common case, not a corner: such copies go through a small bounce buffer
placed half a page away from both ends, which stays in cache.
"""

from __future__ import annotations

import threading

import numpy as np

PAGE = 4096
_ALIASING_WINDOW = 64


class _Bounce(threading.local):
    buffer: np.ndarray | None = None

    def near(self, source: np.ndarray) -> np.ndarray:
        """A scratch array shaped like `source`, starting half a page from it modulo 4096."""
        needed = source.nbytes + 2 * PAGE
        if self.buffer is None or self.buffer.nbytes < needed:
            self.buffer = np.empty(needed, dtype=np.uint8)
        start = (source.ctypes.data + PAGE // 2 - self.buffer.ctypes.data) % PAGE
        return self.buffer[start : start + source.nbytes].view(source.dtype).reshape(source.shape)


_bounce = _Bounce()


def address(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


def aliases_at(destination_address: int, source: np.ndarray) -> bool:
    """Whether a forward copy of `source` to `destination_address` hits 4K aliasing."""
    return 0 < (destination_address - address(source)) % PAGE < _ALIASING_WINDOW


def aliases(destination: np.ndarray, source: np.ndarray) -> bool:
    return aliases_at(address(destination), source)


def copy_array(destination: np.ndarray, source: np.ndarray) -> None:
    """np.copyto(destination, source) at memory speed whatever the two addresses are."""
    if aliases(destination, source):
        bounce = _bounce.near(source)
        np.copyto(bounce, source)
        np.copyto(destination, bounce)
    else:
        np.copyto(destination, source)


def page_offset_array(n_bytes: int, offset: int) -> np.ndarray:
    """A new uint8 array of n_bytes whose data starts `offset` bytes past a page boundary."""
    raw = np.empty(n_bytes + PAGE, dtype=np.uint8)
    start = (offset - raw.ctypes.data) % PAGE
    return raw[start : start + n_bytes]
