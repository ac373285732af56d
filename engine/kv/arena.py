"""KVArena: per-layer MLX cache buffers kept between jobs instead of freed and re-made.

A new MLX buffer costs a zero fill (half a copy) on top of MLX's own allocation; a
buffer handed back when a sequence ends and handed out again to the next one costs
nothing, so rebuilding a cache from blocks is a single copy. Buffers are exclusively
owned while lent: the engine only hands back buffers of sequences it has finished with.
"""

from __future__ import annotations

import threading

import mlx.core as mx

from engine.core.spec import ModelCacheSpec
from engine.kv.buffers import empty_layer_buffers, round_up

LayerBuffers = list[tuple[mx.array, mx.array]]


class KVArena:
    def __init__(self, spec: ModelCacheSpec, max_idle_bytes: int) -> None:
        self.spec = spec
        self.max_idle_bytes = max_idle_bytes
        self._idle: list[tuple[int, LayerBuffers]] = []  # (capacity in tokens, buffers)
        self._lock = threading.Lock()

    @property
    def idle_bytes(self) -> int:
        return sum(capacity for capacity, _ in self._idle) * self.spec.bytes_per_token()

    def take(self, n_tokens: int) -> LayerBuffers:
        """Buffers for at least n_tokens (rounded up to blocks): the smallest idle set that
        fits without wasting more than its request again, else a new one with a block of
        headroom.

        Why the headroom: an agent's next turn is its last one plus a few dozen tokens. Sized
        exactly, its buffers were one block short for that turn (a 730-token turn in 768, the
        next needing 1024), so every later turn made new ones on the step thread: ~0.1 s each
        with the batch running (measured in the 12-agent benchmark), against ~5 ms to copy in
        its cache. With the block, several turns in a row reuse the same buffers.
        """
        capacity = round_up(max(1, n_tokens), self.spec.block_tokens)
        with self._lock:
            fitting = [i for i, (cap, _) in enumerate(self._idle) if capacity <= cap <= 2 * capacity]
            if fitting:
                best = min(fitting, key=lambda i: self._idle[i][0])
                return self._idle.pop(best)[1]
        return empty_layer_buffers(self.spec, capacity + self.spec.block_tokens)

    def give_back(self, buffers: LayerBuffers) -> None:
        """Keep `buffers` for a later take; the caller must hold no other reference to them."""
        capacity = int(buffers[0][0].shape[2])
        with self._lock:
            self._idle.append((capacity, buffers))
            while self._idle and self.idle_bytes > self.max_idle_bytes:
                self._idle.pop(0)
