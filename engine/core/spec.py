"""ModelCacheSpec: the shape of one model's cache, read once from a loaded model, layer by layer.

The spec decides how many bytes a 256-token block takes and is part of every stored
cache's fingerprint, so a cache is never applied to a model it was not made by.

Each entry of `layers` describes one entry of the model's mlx-lm cache list:
- "full": a KVCache (attention over every token);
- "sliding": a RotatingKVCache keeping the last `window` tokens (Gemma 3, Ministral, gpt_oss);
- "state": an ArraysCache (SSM or linear-attention state: mamba, qwen3_next, ...), whose
  arrays have fixed shapes (`state_shapes`, batch dim left out) whatever the length;
- "list": a CacheList of `parts` (hybrids such as falcon_h1: SSM state and KV in one layer).
A KV layer whose heads or head dims differ from the model-wide ones names its own; the
model-wide values are those of the first KV layer, so a model whose layers all agree has
the same spec (and fingerprint) as before per-layer shapes existed.

The engine and store work on the leaves: `kv_layers()` (every KVCache / RotatingKVCache,
in order, CacheList members included) and `state_layers()` (every ArraysCache).
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Literal

BLOCK_TOKENS = 256

LayerKind = Literal["full", "sliding", "state", "list"]

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class LayerSpec:
    kind: LayerKind
    window: int | None = None  # tokens kept by a sliding-window layer
    n_kv_heads: int | None = None  # a KV layer's own shape where it differs from the model-wide one
    k_head_dim: int | None = None
    v_head_dim: int | None = None
    state_shapes: tuple[tuple[int, ...], ...] | None = None  # "state": each array's shape, no batch dim
    state_dtypes: tuple[str, ...] | None = (
        None  # "state": each array's dtype where any differs from the model's
    )
    parts: tuple[LayerSpec, ...] | None = None  # "list": the CacheList's members

    def to_dict(self) -> dict[str, Any]:
        """`kind` and `window` always (as before per-layer shapes), the rest only when set."""
        out: dict[str, Any] = {"kind": self.kind, "window": self.window}
        for name in ("n_kv_heads", "k_head_dim", "v_head_dim"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.state_shapes is not None:
            out["state_shapes"] = [list(shape) for shape in self.state_shapes]
        if self.state_dtypes is not None:
            out["state_dtypes"] = list(self.state_dtypes)
        if self.parts is not None:
            out["parts"] = [part.to_dict() for part in self.parts]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LayerSpec:
        fields = dict(data)
        if fields.get("state_shapes") is not None:
            fields["state_shapes"] = tuple(tuple(int(d) for d in shape) for shape in fields["state_shapes"])
        if fields.get("state_dtypes") is not None:
            fields["state_dtypes"] = tuple(str(d) for d in fields["state_dtypes"])
        if fields.get("parts") is not None:
            fields["parts"] = tuple(cls.from_dict(part) for part in fields["parts"])
        return cls(**fields)


@dataclass(frozen=True)
class KVLayer:
    """One attention cache (KVCache or RotatingKVCache) with its shape resolved."""

    index: int  # position among the KV leaves: the index of its arrays in a KVBlock
    path: tuple[int, ...]  # (model layer,) or (model layer, CacheList member)
    kind: Literal["full", "sliding"]
    window: int | None
    n_kv_heads: int
    k_head_dim: int
    v_head_dim: int

    def bytes_per_token(self, dtype_bytes: int) -> int:
        return self.n_kv_heads * (self.k_head_dim + self.v_head_dim) * dtype_bytes


@dataclass(frozen=True)
class StateLayer:
    """One ArraysCache: fixed-size arrays that cannot be trimmed, only checkpointed."""

    index: int  # position among the state leaves: the index of its arrays in a KVBlock's checkpoint
    path: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]  # one per array: SSM states often run in float32 in a bfloat16 model

    def nbytes(self) -> int:
        total = 0
        for shape, dtype in zip(self.shapes, self.dtypes, strict=True):
            size = DTYPE_BYTES[dtype]
            for dim in shape:
                size *= dim
            total += size
        return total


@dataclass(frozen=True)
class ModelCacheSpec:
    model_name: str
    n_layers: int
    layers: tuple[LayerSpec, ...]
    n_kv_heads: int  # model-wide KV shape: that of the first KV layer (0 for a model without any)
    k_head_dim: int
    v_head_dim: int
    dtype: str  # "float32" | "float16" | "bfloat16"
    block_tokens: int = BLOCK_TOKENS

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def all_full_attention(self) -> bool:
        """Every layer a full-attention KVCache of the model-wide shape: the plain layout
        (one (heads, tokens, dim) shape for all layers) the ragged batch and the fast gather use."""
        return all(
            layer.kind == "full"
            and layer.n_kv_heads is None
            and layer.k_head_dim is None
            and layer.v_head_dim is None
            for layer in self.layers
        )

    @property
    def has_sliding_layers(self) -> bool:
        return any(layer.kind == "sliding" for layer in self.kv_layers())

    @property
    def has_state_layers(self) -> bool:
        return bool(self.state_layers())

    def kv_layers(self) -> tuple[KVLayer, ...]:
        return _leaves(self)[0]

    def state_layers(self) -> tuple[StateLayer, ...]:
        return _leaves(self)[1]

    def bytes_per_token(self) -> int:
        """KV bytes one token adds while it runs (sliding layers counted in full: a bound)."""
        return sum(layer.bytes_per_token(self.dtype_bytes) for layer in self.kv_layers())

    def state_bytes(self) -> int:
        """Bytes of one checkpoint of every SSM / linear-attention state (one per full block)."""
        return sum(layer.nbytes() for layer in self.state_layers())

    def bytes_per_block(self) -> int:
        return self.bytes_per_token() * self.block_tokens + self.state_bytes()

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_tokens)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "n_layers": self.n_layers,
            "layers": [layer.to_dict() for layer in self.layers],
            "n_kv_heads": self.n_kv_heads,
            "k_head_dim": self.k_head_dim,
            "v_head_dim": self.v_head_dim,
            "dtype": self.dtype,
            "block_tokens": self.block_tokens,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelCacheSpec:
        layers = tuple(LayerSpec.from_dict(layer) for layer in data["layers"])
        return cls(**{**data, "layers": layers})

    def fingerprint(self) -> str:
        """Stable hash of everything that must match for a cache to be reusable."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:32]


@functools.lru_cache(maxsize=64)
def _leaves(spec: ModelCacheSpec) -> tuple[tuple[KVLayer, ...], tuple[StateLayer, ...]]:
    kv: list[KVLayer] = []
    states: list[StateLayer] = []

    def visit(layer: LayerSpec, path: tuple[int, ...]) -> None:
        if layer.kind == "list":
            for member, part in enumerate(layer.parts or ()):
                visit(part, (*path, member))
        elif layer.kind == "state":
            shapes = layer.state_shapes or ()
            dtypes = layer.state_dtypes or (spec.dtype,) * len(shapes)
            states.append(StateLayer(len(states), path, shapes, dtypes))
        else:
            kv.append(
                KVLayer(
                    index=len(kv),
                    path=path,
                    kind=layer.kind,
                    window=layer.window,
                    n_kv_heads=spec.n_kv_heads if layer.n_kv_heads is None else layer.n_kv_heads,
                    k_head_dim=spec.k_head_dim if layer.k_head_dim is None else layer.k_head_dim,
                    v_head_dim=spec.v_head_dim if layer.v_head_dim is None else layer.v_head_dim,
                )
            )

    for index, layer in enumerate(spec.layers):
        visit(layer, (index,))
    return tuple(kv), tuple(states)
