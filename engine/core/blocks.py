"""Blocks: the unit in which KV memory is budgeted (BlockPool) and handed out (AgentCache).

A KVBlock holds up to 256 tokens of K and V for every KV layer (engine.core.spec.KVLayer) as
host numpy arrays of shape (n_kv_heads, n_tokens, head_dim). Host arrays because gathering
them back into a cache with numpy runs at several times the speed of MLX's CPU concatenate,
and because the store can write their buffers directly. bfloat16 has no numpy dtype, so
such blocks carry the raw bits as uint16 and the spec's dtype says what they mean.

Models with other layers (engine/core/spec.py) add two things:
- a sliding-window layer keeps only the window: its arrays in a block hold the block's
  *last* t tokens (0 <= t <= n_tokens), those inside the window of the cache's end;
- SSM / linear-attention state cannot be trimmed to an earlier token, so a full block may
  carry a checkpoint: every state layer's arrays after the block's last token. A resume
  starts at the longest checkpoint inside the shared prefix (`AgentCache.resume_point`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from engine.core.errors import CacheMismatchError, PoolExhaustedError, RequestTooLargeError
from engine.core.spec import ModelCacheSpec

NUMPY_STORAGE_DTYPE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


@dataclass(frozen=True)
class QuantParts:
    """What a quantized block holds besides its packed K/V (engine/kv/quant.py): per layer, the
    per-group scales and biases, (n_kv_heads, tokens, head_dim / group_size) in storage dtype."""

    bits: int
    group_size: int
    key_scales: tuple[np.ndarray, ...]
    key_biases: tuple[np.ndarray, ...]
    value_scales: tuple[np.ndarray, ...]
    value_biases: tuple[np.ndarray, ...]

    @property
    def arrays(self) -> list[np.ndarray]:
        return [*self.key_scales, *self.key_biases, *self.value_scales, *self.value_biases]

    def sliced(self, keep: int) -> QuantParts:
        """The parts of the first `keep` tokens (views)."""

        def cut(arrays: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
            return tuple(a[:, :keep] for a in arrays)

        return QuantParts(
            self.bits,
            self.group_size,
            cut(self.key_scales),
            cut(self.key_biases),
            cut(self.value_scales),
            cut(self.value_biases),
        )


@dataclass(frozen=True)
class KVBlock:
    keys: tuple[np.ndarray, ...]  # one (n_kv_heads, tokens held, k_head_dim) array per KV layer
    values: tuple[np.ndarray, ...]
    states: tuple[tuple[np.ndarray, ...], ...] = ()  # a checkpoint: per state layer, its arrays; () = none
    tokens: int | None = None  # the block's token count where keys[0] cannot tell (sliding or no KV layer)
    # Quantized (full attention only): keys/values are then packed uint32, (heads, tokens, dim * bits / 32)
    quant: QuantParts | None = None

    @property
    def n_tokens(self) -> int:
        return self.tokens if self.tokens is not None else int(self.keys[0].shape[1])

    @property
    def nbytes(self) -> int:
        arrays = [*self.keys, *self.values, *(a for state in self.states for a in state)]
        if self.quant is not None:
            arrays += self.quant.arrays
        return sum(a.nbytes for a in arrays)

    def layout(self) -> str:
        """'' for a block holding every token of every KV layer and no checkpoint; otherwise
        which KV layers hold fewer tokens (sliding windows) and whether it carries a checkpoint.
        Two blocks of the same tokens are interchangeable only if their layouts are equal."""
        n = self.n_tokens
        held = [f"{i}:{k.shape[1]}" for i, k in enumerate(self.keys) if int(k.shape[1]) != n]
        return ",".join(held) + ("+ckpt" if self.states else "")


@dataclass
class AgentCache:
    """An agent's saved KV: the token ids it covers and their blocks, in order.

    Every block but the last is full (block_tokens tokens); the last may be partial.
    `conversation` is opaque here: what the worker records about the agent beside its KV (its chat
    messages), carried along so the store writes both as one unit.
    """

    spec: ModelCacheSpec
    token_ids: list[int]
    blocks: list[KVBlock] = field(default_factory=list)
    conversation: bytes | None = None

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        return sum(block.nbytes for block in self.blocks)

    @property
    def quantization(self) -> tuple[int, int] | None:
        """(bits, group size) when its blocks hold K/V quantized, None at full precision."""
        quant = self.blocks[0].quant if self.blocks else None
        return None if quant is None else (quant.bits, quant.group_size)

    def validate(self, spec: ModelCacheSpec) -> None:
        """Raise CacheMismatchError unless this cache fits `spec` and is self-consistent."""
        if self.spec.fingerprint() != spec.fingerprint():
            raise CacheMismatchError(
                f"cache was made for {self.spec.model_name} "
                f"(spec {self.spec.fingerprint()}), not {spec.model_name} ({spec.fingerprint()})"
            )
        covered = sum(block.n_tokens for block in self.blocks)
        if covered != len(self.token_ids):
            raise CacheMismatchError(
                f"cache blocks cover {covered} tokens but it lists {len(self.token_ids)} token ids"
            )
        for index, block in enumerate(self.blocks):
            last = index == len(self.blocks) - 1
            if not last and block.n_tokens != spec.block_tokens:
                raise CacheMismatchError(
                    f"block {index} holds {block.n_tokens} tokens, not {spec.block_tokens}"
                )
        if not spec.all_full_attention:
            for index, block in enumerate(self.blocks):
                _validate_layered_block(index, block, spec)
            return
        storage = NUMPY_STORAGE_DTYPE[spec.dtype]
        if self.quantization is not None:
            for index, block in enumerate(self.blocks):
                _validate_quantized_block(index, block, spec, self.quantization)
            return
        for index, block in enumerate(self.blocks):
            if block.quant is not None:
                raise CacheMismatchError(f"block {index} is quantized, the cache's first block is not")
            if len(block.keys) != spec.n_layers or len(block.values) != spec.n_layers:
                raise CacheMismatchError(f"block {index} has {len(block.keys)} layers, not {spec.n_layers}")
            for k, v in zip(block.keys, block.values, strict=True):
                if k.shape != (spec.n_kv_heads, block.n_tokens, spec.k_head_dim) or v.shape != (
                    spec.n_kv_heads,
                    block.n_tokens,
                    spec.v_head_dim,
                ):
                    raise CacheMismatchError(f"block {index} has arrays of shape {k.shape}/{v.shape}")
                if k.dtype != storage or v.dtype != storage:
                    raise CacheMismatchError(
                        f"block {index} has dtype {k.dtype}, expected {np.dtype(storage)}"
                    )

    def truncated(self, n_tokens: int) -> AgentCache:
        """The first `n_tokens` tokens of this cache (views, no copy).

        A cut block loses its checkpoint (taken after its last token); a sliding layer keeps
        the tokens it held that lie before the cut."""
        n_tokens = min(n_tokens, self.n_tokens)
        block_tokens = self.spec.block_tokens
        blocks: list[KVBlock] = []
        for index, block in enumerate(self.blocks):
            start = index * block_tokens
            if start >= n_tokens:
                break
            keep = min(block.n_tokens, n_tokens - start)
            if keep == block.n_tokens:
                blocks.append(block)
            elif self.spec.all_full_attention:
                blocks.append(
                    KVBlock(
                        keys=tuple(k[:, :keep] for k in block.keys),
                        values=tuple(v[:, :keep] for v in block.values),
                        quant=None if block.quant is None else block.quant.sliced(keep),
                    )
                )
            else:
                first_held = [block.n_tokens - int(k.shape[1]) for k in block.keys]
                blocks.append(
                    KVBlock(
                        keys=tuple(
                            k[:, : max(0, keep - f)] for k, f in zip(block.keys, first_held, strict=True)
                        ),
                        values=tuple(
                            v[:, : max(0, keep - f)] for v, f in zip(block.values, first_held, strict=True)
                        ),
                        tokens=keep,
                    )
                )
        return AgentCache(self.spec, list(self.token_ids[:n_tokens]), blocks, self.conversation)

    def resume_point(self, n_tokens: int) -> int:
        """The most tokens, at most `n_tokens`, that this cache can resume from exactly.

        Full attention resumes anywhere. A sliding layer needs the window before the resume
        point: it holds the window of the cache's end, so it resumes there (or one token
        earlier) or not at all. A state layer resumes only where a checkpoint was taken."""
        n_tokens = min(n_tokens, self.n_tokens)
        if self.spec.all_full_attention or n_tokens <= 0:
            return max(0, n_tokens)
        candidates = [n_tokens]
        if self.spec.state_layers():
            ends = [(i + 1) * self.spec.block_tokens for i, block in enumerate(self.blocks) if block.states]
            candidates = sorted((end for end in ends if end <= n_tokens), reverse=True)
        held_from = self._sliding_held_from()
        for point in candidates:
            if all(max(0, point - window + 1) >= start for window, start in held_from):
                return point
        return 0

    def _sliding_held_from(self) -> list[tuple[int, int]]:
        """(window, first position from which the layer holds every token to the end) per sliding layer."""
        out = []
        block_tokens = self.spec.block_tokens
        for layer in self.spec.kv_layers():
            if layer.kind != "sliding" or layer.window is None:
                continue
            start = self.n_tokens
            for index in range(len(self.blocks) - 1, -1, -1):
                block = self.blocks[index]
                held = int(block.keys[layer.index].shape[1])
                start = index * block_tokens + block.n_tokens - held
                if held < block.n_tokens:
                    break
            out.append((layer.window, start if self.blocks else 0))
        return out


def _validate_quantized_block(
    index: int, block: KVBlock, spec: ModelCacheSpec, quantization: tuple[int, int]
) -> None:
    quant = block.quant
    if quant is None or (quant.bits, quant.group_size) != quantization:
        raise CacheMismatchError(f"block {index} is not quantized as the cache's first block is")
    n, heads, storage = block.n_tokens, spec.n_kv_heads, np.dtype(NUMPY_STORAGE_DTYPE[spec.dtype])
    groups = [
        (block.keys, quant.key_scales, quant.key_biases, spec.k_head_dim),
        (block.values, quant.value_scales, quant.value_biases, spec.v_head_dim),
    ]
    for packed, scales, biases, dim in groups:
        if not len(packed) == len(scales) == len(biases) == spec.n_layers:
            raise CacheMismatchError(f"block {index} has {len(packed)} quantized layers, not {spec.n_layers}")
        for p, s, b in zip(packed, scales, biases, strict=True):
            if p.shape != (heads, n, dim * quant.bits // 32) or p.dtype != np.uint32:
                raise CacheMismatchError(f"block {index} has packed values of shape {p.shape} ({p.dtype})")
            for part in (s, b):
                if part.shape != (heads, n, dim // quant.group_size) or part.dtype != storage:
                    raise CacheMismatchError(
                        f"block {index} has scales or biases of shape {part.shape} ({part.dtype})"
                    )


def _validate_layered_block(index: int, block: KVBlock, spec: ModelCacheSpec) -> None:
    kv_layers, state_layers = spec.kv_layers(), spec.state_layers()
    if len(block.keys) != len(kv_layers) or len(block.values) != len(kv_layers):
        raise CacheMismatchError(f"block {index} has {len(block.keys)} KV layers, not {len(kv_layers)}")
    storage = NUMPY_STORAGE_DTYPE[spec.dtype]
    n = block.n_tokens
    for layer, k, v in zip(kv_layers, block.keys, block.values, strict=True):
        held = int(k.shape[1])
        if (layer.kind == "full" and held != n) or not 0 <= held <= n:
            raise CacheMismatchError(f"block {index} layer {layer.path} holds {held} of its {n} tokens")
        if k.shape != (layer.n_kv_heads, held, layer.k_head_dim) or v.shape != (
            layer.n_kv_heads,
            held,
            layer.v_head_dim,
        ):
            raise CacheMismatchError(
                f"block {index} layer {layer.path} has arrays of shape {k.shape}/{v.shape}"
            )
        if k.dtype != storage or v.dtype != storage:
            raise CacheMismatchError(f"block {index} has dtype {k.dtype}, expected {np.dtype(storage)}")
    if not block.states:
        return
    if n != spec.block_tokens or len(block.states) != len(state_layers):
        raise CacheMismatchError(f"block {index} carries a checkpoint it cannot have")
    for state_layer, arrays in zip(state_layers, block.states, strict=True):
        expected = [
            (shape, np.dtype(NUMPY_STORAGE_DTYPE[dtype]))
            for shape, dtype in zip(state_layer.shapes, state_layer.dtypes, strict=True)
        ]
        if [(tuple(a.shape), a.dtype) for a in arrays] != expected:
            raise CacheMismatchError(f"block {index} checkpoint of layer {state_layer.path} has other arrays")


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class BlockPool:
    """A fixed budget of KV blocks shared by all running sequences.

    The pool does the accounting (which owner holds how many blocks); the KV bytes
    themselves live in MLX's batch cache while a sequence runs. Reserving up front
    means a running sequence never dies half-way for lack of memory.
    """

    def __init__(self, total_blocks: int) -> None:
        if total_blocks <= 0:
            raise ValueError(f"a block pool needs at least one block, got {total_blocks}")
        self.total_blocks = total_blocks
        self._free: list[int] = list(range(total_blocks - 1, -1, -1))
        self._owned: dict[object, list[int]] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_megabytes(
        cls, megabytes: float, spec: ModelCacheSpec, bytes_per_block: int | None = None
    ) -> BlockPool:
        """As many blocks as `megabytes` holds, each `bytes_per_block` (default: the spec's at
        full precision; a quantized pool passes its smaller size)."""
        size = bytes_per_block or spec.bytes_per_block()
        blocks = int(megabytes * 1024 * 1024 // size)
        if blocks <= 0:
            raise ValueError(f"{megabytes} MB holds no block of {size} bytes for {spec.model_name}")
        return cls(blocks)

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.total_blocks - len(self._free)

    def held_by(self, owner: object) -> int:
        return len(self._owned.get(owner, ()))

    def can_allocate(self, n_blocks: int) -> bool:
        return n_blocks <= len(self._free)

    def allocate(self, owner: object, n_blocks: int) -> list[int]:
        """Give `owner` n more blocks, or raise without changing anything."""
        if n_blocks > self.total_blocks:
            raise RequestTooLargeError(
                f"request needs {n_blocks} blocks but the whole pool holds {self.total_blocks}"
            )
        with self._lock:
            if n_blocks > len(self._free):
                raise PoolExhaustedError(n_blocks, len(self._free), self.total_blocks)
            taken = [self._free.pop() for _ in range(n_blocks)]
            self._owned.setdefault(owner, []).extend(taken)
            return taken

    def rename(self, old: object, new: object) -> None:
        """Move `old`'s blocks to `new` (an allocation made before its final key was known)."""
        with self._lock:
            self._owned.setdefault(new, []).extend(self._owned.pop(old, []))

    def free(self, owner: object) -> int:
        """Return every block `owner` holds; freeing an unknown owner is a no-op."""
        with self._lock:
            blocks = self._owned.pop(owner, [])
            self._free.extend(blocks)
            return len(blocks)
