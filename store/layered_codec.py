"""Block blobs of models whose layers are not all plain full attention (docs/store-format.md).

store/block_codec.py hands such specs (engine/core/spec.py: sliding windows, per-layer shapes,
SSM / linear-attention state) to this module. One blob per block, as for plain models:
- `L{i}.k` / `L{i}.v` for KV layer i (spec.kv_layers() order), shape (heads, held, dim),
  where `held` is the block's token count for full attention and the tokens of the block
  inside the window for a sliding layer (the block's last `held` tokens, possibly 0);
  quantized: `L{i}.k.q`, `.scales`, `.biases` per layer (layers differ in shape, so each is
  quantized on its own); a layer holding no token is stored as empty raw tensors;
- `S{j}.{a}` for array a of state layer j, in that array's own dtype, never quantized (a
  checkpoint: the state after the block's last token), present only in blocks that carry one.
Metadata is the plain block's plus `layout` (engine.core.blocks.KVBlock.layout), which must agree
with the tensors found.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from engine.core.blocks import KVBlock
from engine.core.spec import KVLayer, ModelCacheSpec
from store import quant
from store.errors import BAD_BLOCK, BadCacheError
from store.stfile import TensorEntry, view

_ST_DTYPE = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def encode_layered(
    block: KVBlock, spec: ModelCacheSpec, quantization: str, group_size: int
) -> tuple[list[tuple[str, str, np.ndarray]], dict[str, str]]:
    """The tensors (name, safetensors dtype, array) of one block, and the metadata it adds."""
    dtype = _ST_DTYPE[spec.dtype]
    tensors: list[tuple[str, str, np.ndarray]] = []
    for layer, k, v in zip(spec.kv_layers(), block.keys, block.values, strict=True):
        for kind, array in (("k", k), ("v", v)):
            name = f"L{layer.index}.{kind}"
            if quantization == "none" or array.shape[1] == 0:
                tensors.append((name, dtype, np.ascontiguousarray(array)))
                continue
            packed, scales, biases = quant.quantize(
                array, spec.dtype, quant.QUANT_BITS[quantization], group_size
            )
            tensors += [(f"{name}.q", "U32", packed), (f"{name}.scales", dtype, scales)]
            tensors.append((f"{name}.biases", dtype, biases))
    for state_layer, arrays in zip(spec.state_layers(), block.states, strict=False):
        for a, (array, array_dtype) in enumerate(zip(arrays, state_layer.dtypes, strict=True)):
            tensors.append((f"S{state_layer.index}.{a}", _ST_DTYPE[array_dtype], np.ascontiguousarray(array)))
    return tensors, {"layout": block.layout()}


def decode_layered(
    blob: bytes | bytearray | memoryview,
    block_name: str,
    n_tokens: int,
    spec: ModelCacheSpec,
    quantization: str,
    group_size: int,
    metadata: Mapping[str, str],
    plain_metadata: Mapping[str, str],
    entries: Mapping[str, TensorEntry],
    data_start: int,
) -> KVBlock:
    """The block, after checking that its tensors are exactly what its layout and spec allow."""
    held = [_held_tokens(entries, layer, n_tokens, block_name) for layer in spec.kv_layers()]
    has_checkpoint = any(name.startswith("S") for name in entries)
    if has_checkpoint and n_tokens != spec.block_tokens:
        raise BadCacheError(BAD_BLOCK, f"block {block_name} of {n_tokens} tokens carries a checkpoint")
    expected = _expected(spec, quantization, group_size, held, has_checkpoint)
    got = {name: (e.dtype, e.shape) for name, e in entries.items()}
    if got != expected:
        raise BadCacheError(BAD_BLOCK, f"block {block_name} holds other tensors than expected")
    layout = [f"{layer.index}:{t}" for layer, t in zip(spec.kv_layers(), held, strict=True) if t != n_tokens]
    expected_meta = {**plain_metadata, "layout": ",".join(layout) + ("+ckpt" if has_checkpoint else "")}
    if dict(metadata) != expected_meta:
        raise BadCacheError(BAD_BLOCK, f"block {block_name} metadata {dict(metadata)} is not {expected_meta}")
    keys: list[np.ndarray] = []
    values: list[np.ndarray] = []
    for layer in spec.kv_layers():
        for kind, out in (("k", keys), ("v", values)):
            name = f"L{layer.index}.{kind}"
            if name in entries:
                out.append(view(blob, entries[name], data_start))
                continue
            parts = [view(blob, entries[f"{name}.{part}"], data_start) for part in ("q", "scales", "biases")]
            bits = quant.QUANT_BITS[quantization]
            out.append(quant.dequantize(parts[0], parts[1], parts[2], spec.dtype, bits, group_size))
    states = (
        tuple(
            tuple(view(blob, entries[f"S{layer.index}.{a}"], data_start) for a in range(len(layer.shapes)))
            for layer in spec.state_layers()
        )
        if has_checkpoint
        else ()
    )
    return KVBlock(tuple(keys), tuple(values), states, tokens=n_tokens)


def _held_tokens(entries: Mapping[str, TensorEntry], layer: KVLayer, n_tokens: int, block_name: str) -> int:
    """How many tokens the blob holds for this layer (its K tensor's second dim)."""
    entry = entries.get(f"L{layer.index}.k") or entries.get(f"L{layer.index}.k.q")
    if entry is None or len(entry.shape) != 3:
        raise BadCacheError(BAD_BLOCK, f"block {block_name} has no keys for layer {layer.path}")
    held = int(entry.shape[1])
    if held > n_tokens or (layer.kind == "full" and held != n_tokens):
        raise BadCacheError(
            BAD_BLOCK, f"block {block_name} holds {held} tokens of {n_tokens} for {layer.path}"
        )
    return held


def _expected(
    spec: ModelCacheSpec, quantization: str, group_size: int, held: list[int], has_checkpoint: bool
) -> dict[str, tuple[str, tuple[int, ...]]]:
    dtype = _ST_DTYPE[spec.dtype]
    expected: dict[str, tuple[str, tuple[int, ...]]] = {}
    for layer, tokens in zip(spec.kv_layers(), held, strict=True):
        for kind, dim in (("k", layer.k_head_dim), ("v", layer.v_head_dim)):
            name = f"L{layer.index}.{kind}"
            if quantization == "none" or tokens == 0:
                expected[name] = (dtype, (layer.n_kv_heads, tokens, dim))
                continue
            bits = quant.QUANT_BITS[quantization]
            expected[f"{name}.q"] = ("U32", (layer.n_kv_heads, tokens, dim * bits // 32))
            expected[f"{name}.scales"] = (dtype, (layer.n_kv_heads, tokens, dim // group_size))
            expected[f"{name}.biases"] = (dtype, (layer.n_kv_heads, tokens, dim // group_size))
    if has_checkpoint:
        for state_layer in spec.state_layers():
            for a, (shape, array_dtype) in enumerate(
                zip(state_layer.shapes, state_layer.dtypes, strict=True)
            ):
                expected[f"S{state_layer.index}.{a}"] = (_ST_DTYPE[array_dtype], shape)
    return expected


def head_dims(spec: ModelCacheSpec) -> tuple[int, ...]:
    """Every KV head dim quantization must divide (none for a model without KV layers)."""
    return tuple(dim for layer in spec.kv_layers() for dim in (layer.k_head_dim, layer.v_head_dim))
