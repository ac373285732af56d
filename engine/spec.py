"""ModelCacheSpec: the shape of one model's KV cache, read once from a loaded model.

The spec decides how many bytes a 256-token block takes and is part of every stored
cache's fingerprint, so a cache is never applied to a model it was not made by.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any, Literal

from engine.errors import UnsupportedModelError

BLOCK_TOKENS = 256

LayerKind = Literal["full", "sliding"]

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class LayerSpec:
    kind: LayerKind
    window: int | None = None  # tokens kept by a sliding-window layer


@dataclass(frozen=True)
class ModelCacheSpec:
    model_name: str
    n_layers: int
    layers: tuple[LayerSpec, ...]
    n_kv_heads: int
    k_head_dim: int
    v_head_dim: int
    dtype: str  # "float32" | "float16" | "bfloat16"
    block_tokens: int = BLOCK_TOKENS

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    @property
    def all_full_attention(self) -> bool:
        """Only full-attention caches can be cut into blocks and resumed exactly."""
        return all(layer.kind == "full" for layer in self.layers)

    def bytes_per_token(self) -> int:
        per_layer = self.n_kv_heads * (self.k_head_dim + self.v_head_dim) * self.dtype_bytes
        return per_layer * self.n_layers

    def bytes_per_block(self) -> int:
        return self.bytes_per_token() * self.block_tokens

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_tokens)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelCacheSpec:
        layers = tuple(LayerSpec(**layer) for layer in data["layers"])
        return cls(**{**data, "layers": layers})

    def fingerprint(self) -> str:
        """Stable hash of everything that must match for a cache to be reusable."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:32]


def spec_from_model(model: Any, model_name: str) -> ModelCacheSpec:
    """Read the cache layout from a loaded mlx-lm model by building one empty cache of it."""
    import mlx.core as mx
    from mlx_lm.models import cache as cache_mod

    caches = cache_mod.make_prompt_cache(model)
    layers: list[LayerSpec] = []
    for index, layer_cache in enumerate(caches):
        layers.append(_layer_spec(index, layer_cache, cache_mod))
    # Probe one token through the model to learn head counts, head dims and dtype:
    # configs name these fields differently across architectures, the cache does not.
    probe = cache_mod.make_prompt_cache(model)
    model(mx.array([[0]]), cache=probe)
    keys, values = _first_kv(probe)
    mx.eval(keys, values)
    dtype = str(keys.dtype).removeprefix("mlx.core.")
    if dtype not in _DTYPE_BYTES:
        raise UnsupportedModelError(f"KV dtype {dtype} is not supported")
    return ModelCacheSpec(
        model_name=model_name,
        n_layers=len(caches),
        layers=tuple(layers),
        n_kv_heads=int(keys.shape[1]),
        k_head_dim=int(keys.shape[3]),
        v_head_dim=int(values.shape[3]),
        dtype=dtype,
    )


def _layer_spec(index: int, layer_cache: Any, cache_mod: Any) -> LayerSpec:
    # Exact type checks: subclasses may change what the state means.
    if type(layer_cache) is cache_mod.KVCache:
        return LayerSpec("full")
    if type(layer_cache) is cache_mod.RotatingKVCache:
        return LayerSpec("sliding", window=int(layer_cache.max_size))
    raise UnsupportedModelError(
        f"layer {index} uses {type(layer_cache).__name__}, which the block pool cannot hold "
        "(supported: KVCache, RotatingKVCache)"
    )


def _first_kv(caches: list[Any]) -> tuple[Any, Any]:
    state = caches[0].state
    return state[0], state[1]
