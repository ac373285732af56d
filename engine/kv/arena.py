"""KVArena: per-layer MLX cache buffers kept between jobs instead of freed and re-made.

A new MLX buffer costs a zero fill (half a copy) on top of MLX's own allocation; a
buffer handed back when a sequence ends and handed out again to the next one costs
nothing, so rebuilding a cache from blocks is a single copy. Buffers are exclusively
owned while lent: the engine only hands back buffers of sequences it has finished with.

Where no idle buffers fit (a fresh process, a longer agent than any before), `reserve` makes
them ahead on a background thread, so the step thread does not pay for the new pages when the
sequence joins: measured on this project's 2-core VM, a fresh process's buffers for one
860-token SmolLM2 agent (59 MB) took 0.2-0.3 s of page faults, and twelve agents returning to a
restarted worker at once were admitted one after another with the whole batch waiting.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import mlx.core as mx

from engine.core.spec import ModelCacheSpec
from engine.kv.buffers import empty_layer_buffers, round_up, yield_to_the_step

LayerBuffers = list[tuple[mx.array, mx.array]]


#: Claims (reservations not yet taken) remembered at most: one whose sequence never came (a job
#: canceled while it waited) must not keep later ones from making their sets for ever.
MAX_CLAIMS = 64


class KVArena:
    def __init__(self, spec: ModelCacheSpec, max_idle_bytes: int, background: bool | None = None) -> None:
        """`background` (default: on the CPU device only): `reserve` and `stock` make sets on a
        thread of their own. MLX arrays made on another thread are used here once evaluated; that
        is verified on the CPU, where new pages are what costs, not on Metal or CUDA, where
        `reserve` then does nothing and `stock` makes its sets on the calling thread."""
        self.spec = spec
        self.max_idle_bytes = max_idle_bytes
        self.background = mx.default_device() == mx.cpu if background is None else background
        self._idle: list[tuple[int, LayerBuffers, bool]] = []  # (capacity in tokens, buffers, reserved)
        self._making: list[tuple[int, Future[LayerBuffers]]] = []  # reserved, being made
        self._claims: list[int] = []  # capacities reserved and not taken yet, oldest first
        # Reentrant: a set made before its done-callback is attached (under this lock) runs the
        # callback, which takes the lock, on this very thread.
        self._lock = threading.RLock()
        self._maker: ThreadPoolExecutor | None = None
        self.reserved = 0  # sets made ahead (reserve, stock)
        self.reserved_used = 0  # of those, taken by a sequence

    @property
    def idle_bytes(self) -> int:
        return sum(entry[0] for entry in self._idle) * self.spec.bytes_per_token()

    def _capacity(self, n_tokens: int) -> int:
        return round_up(max(1, n_tokens), self.spec.block_tokens)

    @staticmethod
    def _fits(wanted: int, capacity: int) -> bool:
        """A set fits a request it holds without wasting more than the request again."""
        return wanted <= capacity <= 2 * wanted

    def take(self, n_tokens: int) -> LayerBuffers:
        """Buffers for at least n_tokens (rounded up to blocks): the smallest idle set that
        fits without wasting more than its request again, else one being made ahead for it
        (`reserve`), else a new one with a block of headroom.

        Why the headroom: an agent's next turn is its last one plus a few dozen tokens. Sized
        exactly, its buffers were one block short for that turn (a 730-token turn in 768, the
        next needing 1024), so every later turn made new ones on the step thread: ~0.1 s each
        with the batch running (measured in the 12-agent benchmark), against ~5 ms to copy in
        its cache. With the block, several turns in a row reuse the same buffers.
        """
        capacity = self._capacity(n_tokens)
        with self._lock:
            claimed = [i for i, cap in enumerate(self._claims) if cap == capacity]
            if claimed:
                del self._claims[claimed[0]]
            fitting = [i for i, entry in enumerate(self._idle) if self._fits(capacity, entry[0])]
            if fitting:
                _, buffers, reserved = self._idle.pop(min(fitting, key=lambda i: self._idle[i][0]))
                self.reserved_used += reserved
                return buffers
            making = [i for i, (cap, _) in enumerate(self._making) if self._fits(capacity, cap)]
            future = self._making.pop(min(making, key=lambda i: self._making[i][0]))[1] if making else None
        if future is not None:
            try:
                buffers = future.result()  # started earlier: what is left of it is less than a new one
            except Exception:
                return self._new(capacity)  # making it failed there: try here, raising if it fails again
            self.reserved_used += 1
            return buffers
        return self._new(capacity)

    def _new(self, capacity: int) -> LayerBuffers:
        return empty_layer_buffers(self.spec, capacity + self.spec.block_tokens)

    def reserve(self, n_tokens: int) -> bool:
        """Claim a set for a sequence of n_tokens that will `take` it soon; make one on the
        background thread unless a set that fits is idle or being made and not claimed by an
        earlier reservation: True if one was started. A set nobody takes stays idle like a
        given-back one (within `max_idle_bytes`)."""
        if not self.background:
            return False
        capacity = self._capacity(n_tokens)
        with self._lock:
            self._claims.append(capacity)
            del self._claims[:-MAX_CLAIMS]
            claims = sum(1 for cap in self._claims if self._fits(cap, capacity) or self._fits(capacity, cap))
            sets = sum(1 for entry in self._idle if self._fits(capacity, entry[0]))
            sets += sum(1 for cap, _ in self._making if self._fits(capacity, cap))
            if sets >= claims:
                return False
            return self._start(capacity)

    def stock(self, n_tokens: int) -> bool:
        """Make an idle set for a sequence of n_tokens expected later (a worker starting: its
        returning agents), on the background thread, within the idle budget: True if started."""
        capacity = self._capacity(n_tokens)
        if not self.background:
            with self._lock:
                if not self._room_for(capacity):
                    return False
            self.give_back(self._new(capacity), reserved=True)
            self.reserved += 1
            return True
        with self._lock:
            return self._start(capacity)

    def _start(self, capacity: int) -> bool:
        """Start making a set (the lock held): False where the idle budget could not keep it."""
        if not self._room_for(capacity):
            return False  # it could not be kept: leave it to take()
        if self._maker is None:
            self._maker = ThreadPoolExecutor(
                1, thread_name_prefix="kvrq-arena", initializer=yield_to_the_step
            )
        entry = (capacity, self._maker.submit(self._new, capacity))
        self._making.append(entry)
        self.reserved += 1
        entry[1].add_done_callback(lambda _: self._made(entry))
        return True

    def _room_for(self, capacity: int) -> bool:
        """Whether the idle budget keeps one more set of `capacity` (the lock held)."""
        block = self.spec.block_tokens  # each set is made with a block of headroom (_new)
        making = sum(cap + block for cap, _ in self._making)
        needed = self.idle_bytes + (making + capacity + block) * self.spec.bytes_per_token()
        return needed <= self.max_idle_bytes

    def wait_made(self) -> None:
        """Until every set being made is made (a worker's warm-up, before it takes jobs)."""
        with self._lock:
            futures = [future for _, future in self._making]
        for future in futures:
            future.exception()

    def _made(self, entry: tuple[int, Future[LayerBuffers]]) -> None:
        """A reserved set is ready: idle from now on, unless take() already claimed it."""
        _, future = entry
        with self._lock:
            if entry not in self._making:
                return  # claimed by take(), which waits on the future itself
            self._making.remove(entry)
        if future.exception() is None:
            self.give_back(future.result(), reserved=True)

    def give_back(self, buffers: LayerBuffers, reserved: bool = False) -> None:
        """Keep `buffers` for a later take; the caller must hold no other reference to them."""
        capacity = int(buffers[0][0].shape[2])
        with self._lock:
            self._idle.append((capacity, buffers, reserved))
            while self._idle and self.idle_bytes > self.max_idle_bytes:
                self._idle.pop(0)

    def close(self) -> None:
        """Stop the background thread (what it is making is finished and dropped)."""
        if self._maker is not None:
            self._maker.shutdown(wait=True)
            self._maker = None
