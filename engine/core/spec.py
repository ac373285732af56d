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

from engine.core.errors import UnsupportedModelError

BLOCK_TOKENS = 256

LayerKind = Literal["full", "sliding", "state", "list"]

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


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
            size = _DTYPE_BYTES[dtype]
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
        return _DTYPE_BYTES[self.dtype]

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


def spec_from_model(model: Any, model_name: str) -> ModelCacheSpec:
    """Read the cache layout from a loaded mlx-lm model by running one token through a fresh cache.

    Configs name heads and head dims differently across architectures (and MLA caches a
    latent, not heads); the filled cache says what is actually stored, layer by layer.
    Raises UnsupportedModelError naming the first layer the engine cannot hold, and why.
    """
    import mlx.core as mx
    from mlx_lm.models import cache as cache_mod

    probe = cache_mod.make_prompt_cache(model)
    for index, layer_cache in enumerate(probe):
        _check_kind(index, layer_cache, cache_mod)
    model(mx.array([[0]]), cache=probe)
    mx.eval([layer_cache.state for layer_cache in probe])
    raw = [_raw_layer(str(index), layer_cache, cache_mod) for index, layer_cache in enumerate(probe)]
    layers = [layer for layer, _ in raw]
    kv_dtypes = {dtype for _, dtypes in raw for dtype in dtypes}
    if len(kv_dtypes) > 1:
        raise UnsupportedModelError(
            f"KV layers mix dtypes {sorted(kv_dtypes)}: one KV dtype per model is supported"
        )
    state_dtypes = [d for layer in _state_leaves(layers) for d in layer.state_dtypes or ()]
    dtype = kv_dtypes.pop() if kv_dtypes else state_dtypes[0]
    for name in {dtype, *state_dtypes}:
        if name not in _DTYPE_BYTES:
            raise UnsupportedModelError(f"cache dtype {name} is not supported (float32, float16, bfloat16)")
    first_kv = next((leaf for leaf in _kv_leaves(layers)), None)
    heads, k_dim, v_dim = (
        (first_kv.n_kv_heads or 0, first_kv.k_head_dim or 0, first_kv.v_head_dim or 0)
        if first_kv
        else (0, 0, 0)
    )
    return ModelCacheSpec(
        model_name=model_name,
        n_layers=len(probe),
        layers=tuple(_relative(layer, heads, k_dim, v_dim, dtype) for layer in layers),
        n_kv_heads=heads,
        k_head_dim=k_dim,
        v_head_dim=v_dim,
        dtype=dtype,
    )


def _check_kind(index: int, layer_cache: Any, cache_mod: Any, where: str = "") -> None:
    # Exact type checks: subclasses may change what the state means.
    name = f"layer {index}{where}"
    kind = type(layer_cache)
    if kind in (cache_mod.KVCache, cache_mod.ArraysCache):
        return
    if kind is cache_mod.RotatingKVCache:
        if layer_cache.keep:
            raise UnsupportedModelError(
                f"{name} uses a RotatingKVCache that keeps {layer_cache.keep} leading tokens: "
                "only plain sliding windows (keep=0) can be cut into blocks"
            )
        return
    if kind is cache_mod.CacheList:
        for member, part in enumerate(layer_cache.caches):
            if type(part) is cache_mod.CacheList:
                raise UnsupportedModelError(f"{name} nests a CacheList in a CacheList")
            _check_kind(index, part, cache_mod, f"{where} member {member}")
        return
    reasons = {
        "QuantizedKVCache": "mlx-lm cannot batch it (no merge)",
        "ChunkedKVCache": "mlx-lm cannot batch it (no merge; chunked attention as in llama4)",
        "ConcatenateKVCache": "mlx-lm cannot batch it (no merge)",
    }
    reason = reasons.get(kind.__name__, "the engine cannot batch or cut it into blocks")
    raise UnsupportedModelError(
        f"{name} uses {kind.__name__}: {reason} (supported: KVCache, RotatingKVCache, ArraysCache, CacheList)"
    )


def _raw_layer(name: str, layer_cache: Any, cache_mod: Any) -> tuple[LayerSpec, list[str]]:
    """The layer's spec with absolute shapes and state dtypes, and the dtypes of its KV arrays."""
    kind = type(layer_cache)
    if kind is cache_mod.CacheList:
        parts = [_raw_layer(f"{name}.{i}", part, cache_mod) for i, part in enumerate(layer_cache.caches)]
        return LayerSpec("list", parts=tuple(p for p, _ in parts)), [d for _, ds in parts for d in ds]
    if kind is cache_mod.ArraysCache:
        arrays = list(layer_cache.cache)
        if any(a is None for a in arrays):
            raise UnsupportedModelError(f"layer {name}: ArraysCache left an array unset after one token")
        shapes = tuple(tuple(int(d) for d in a.shape[1:]) for a in arrays)
        return LayerSpec("state", state_shapes=shapes, state_dtypes=tuple(_dtype_name(a) for a in arrays)), []
    keys, values = layer_cache.keys, layer_cache.values
    heads, k_dim, v_dim = int(keys.shape[1]), int(keys.shape[3]), int(values.shape[3])
    if int(values.shape[1]) != heads:
        raise UnsupportedModelError(f"layer {name}: keys have {heads} heads but values {values.shape[1]}")
    if _dtype_name(keys) != _dtype_name(values):
        raise UnsupportedModelError(
            f"layer {name}: keys are {_dtype_name(keys)}, values {_dtype_name(values)}"
        )
    window = int(layer_cache.max_size) if kind is cache_mod.RotatingKVCache else None
    layer = LayerSpec(
        "sliding" if window else "full", window, n_kv_heads=heads, k_head_dim=k_dim, v_head_dim=v_dim
    )
    return layer, [_dtype_name(keys)]


def _dtype_name(array: Any) -> str:
    return str(array.dtype).removeprefix("mlx.core.")


def _kv_leaves(layers: list[LayerSpec]) -> list[LayerSpec]:
    out: list[LayerSpec] = []
    for layer in layers:
        if layer.kind == "list":
            out.extend(_kv_leaves(list(layer.parts or ())))
        elif layer.kind in ("full", "sliding"):
            out.append(layer)
    return out


def _state_leaves(layers: list[LayerSpec]) -> list[LayerSpec]:
    out: list[LayerSpec] = []
    for layer in layers:
        if layer.kind == "list":
            out.extend(_state_leaves(list(layer.parts or ())))
        elif layer.kind == "state":
            out.append(layer)
    return out


def _relative(layer: LayerSpec, heads: int, k_dim: int, v_dim: int, dtype: str) -> LayerSpec:
    """The layer with shapes and dtypes equal to the model-wide ones left unset (None)."""
    if layer.kind == "list":
        parts = tuple(_relative(p, heads, k_dim, v_dim, dtype) for p in layer.parts or ())
        return LayerSpec("list", parts=parts)
    if layer.kind == "state":
        same = all(d == dtype for d in layer.state_dtypes or ())
        return LayerSpec(
            "state", state_shapes=layer.state_shapes, state_dtypes=None if same else layer.state_dtypes
        )
    return LayerSpec(
        layer.kind,
        window=layer.window,
        n_kv_heads=None if layer.n_kv_heads == heads else layer.n_kv_heads,
        k_head_dim=None if layer.k_head_dim == k_dim else layer.k_head_dim,
        v_head_dim=None if layer.v_head_dim == v_dim else layer.v_head_dim,
    )
