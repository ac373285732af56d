"""Reading a loaded mlx-lm model's cache layout (its ModelCacheSpec) by running one token.

Why here and not in engine/core/spec.py: the spec itself is plain data the store and the worker's
scheduling read without MLX; finding it out takes the model, MLX and mlx-lm's cache classes.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as cache_mod

from engine.core.errors import UnsupportedModelError
from engine.core.spec import DTYPE_BYTES, LayerSpec, ModelCacheSpec


def spec_from_model(model: Any, model_name: str) -> ModelCacheSpec:
    """Read the cache layout from a loaded mlx-lm model by running one token through a fresh cache.

    Configs name heads and head dims differently across architectures (and MLA caches a
    latent, not heads); the filled cache says what is actually stored, layer by layer.
    Raises UnsupportedModelError naming the first layer the engine cannot hold, and why.
    """

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
        if name not in DTYPE_BYTES:
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
