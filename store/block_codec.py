"""Block blobs: one safetensors blob per 256-token block (format: docs/store-format.md).

A block blob holds tensors `L{layer}.k` / `L{layer}.v` in the spec's dtype, or when
quantized `L{layer}.k.q` (packed uint32) with `.scales` and `.biases`. Encoding hands
back the header plus views of the block's own arrays, so writers can send them
without concatenating; decoding checks size, CRC-32, header, metadata and every
tensor's dtype and shape before returning zero-copy views.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from engine.core.blocks import KVBlock, QuantParts
from engine.core.spec import ModelCacheSpec
from store import layered_codec, quant
from store.checksum import crc32
from store.errors import BAD_BLOCK, CHECKSUM, TRUNCATED, BadCacheError
from store.iopool import crc32_async
from store.manifest import BLOCK_FORMAT_VERSION, FORMAT_NAME, BlockRef, Manifest, spec_fingerprint
from store.stfile import SafetensorsError, encode, parse_header, view

_ST_DTYPE = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


@dataclass(frozen=True)
class EncodedBlock:
    """One block blob as header + buffers (views of the arrays: nothing concatenated).

    Its CRC-32 is computed on the store's helper threads while the blob is written.
    """

    header: bytes
    buffers: list[memoryview]
    nbytes: int
    crc: Future[int]

    def parts(self) -> list[bytes | memoryview]:
        return [self.header, *self.buffers]

    @property
    def crc32(self) -> int:
        return self.crc.result()


def _block_metadata(
    spec: ModelCacheSpec, quantization: str, group_size: int, n_tokens: int
) -> dict[str, str]:
    return {
        "format": FORMAT_NAME,
        "version": str(BLOCK_FORMAT_VERSION),
        "kind": "block",
        "fingerprint": spec_fingerprint(spec),
        "dtype": spec.dtype,
        "n_tokens": str(n_tokens),
        "quantization": quantization,
        "group_size": str(group_size),
    }


def encode_block(block: KVBlock, spec: ModelCacheSpec, quantization: str, group_size: int) -> EncodedBlock:
    """Serialize one block; for `none` the buffers are the block's own arrays."""
    dtype = _ST_DTYPE[spec.dtype]
    tensors: list[tuple[str, str, np.ndarray]] = []
    metadata = _block_metadata(spec, quantization, group_size, block.n_tokens)
    if not spec.all_full_attention:  # sliding windows, per-layer shapes, SSM checkpoints
        tensors, extra = layered_codec.encode_layered(block, spec, quantization, group_size)
        metadata.update(extra)
    elif block.quant is not None and (block.quant.bits, block.quant.group_size) == (
        quant.QUANT_BITS.get(quantization),
        group_size,
    ):  # a block of a pool quantized as this store is: written as it is
        parts = block.quant
        for layer in range(spec.n_layers):
            for kind, stored, stored_scales, stored_biases in (
                ("k", block.keys, parts.key_scales, parts.key_biases),
                ("v", block.values, parts.value_scales, parts.value_biases),
            ):
                tensors.append((f"L{layer}.{kind}.q", "U32", np.ascontiguousarray(stored[layer])))
                tensors.append((f"L{layer}.{kind}.scales", dtype, np.ascontiguousarray(stored_scales[layer])))
                tensors.append((f"L{layer}.{kind}.biases", dtype, np.ascontiguousarray(stored_biases[layer])))
    elif quantization == "none":
        block = _full_precision(block, spec)
        for layer, (k, v) in enumerate(zip(block.keys, block.values, strict=True)):
            tensors.append((f"L{layer}.k", dtype, np.ascontiguousarray(k)))
            tensors.append((f"L{layer}.v", dtype, np.ascontiguousarray(v)))
    else:
        bits = quant.QUANT_BITS[quantization]
        block = _full_precision(block, spec)  # a block of a pool quantized otherwise: converted once
        quantized = {
            kind: quant.quantize(np.stack(arrays), spec.dtype, bits, group_size)
            for kind, arrays in (("k", block.keys), ("v", block.values))
        }
        for layer in range(spec.n_layers):
            for kind in ("k", "v"):
                packed, scales, biases = quantized[kind]
                tensors.append((f"L{layer}.{kind}.q", "U32", packed[layer]))
                tensors.append((f"L{layer}.{kind}.scales", dtype, scales[layer]))
                tensors.append((f"L{layer}.{kind}.biases", dtype, biases[layer]))
    header, buffers = encode(tensors, metadata)
    blob_parts: list[bytes | memoryview] = [header, *buffers]
    nbytes = len(header) + sum(len(b) for b in buffers)
    return EncodedBlock(header, buffers, nbytes, crc32_async(blob_parts))


def decode_block(
    blob: bytes | bytearray | memoryview, ref: BlockRef, manifest: Manifest, *, crc: int | None = None
) -> KVBlock:
    """The block from its blob, after checking size, CRC-32, header and every tensor's shape.

    Raises BadCacheError (truncated, checksum, bad_block). `crc` is the blob's CRC-32 if
    the caller already computed it (on a reader thread).
    """
    if len(blob) != ref.nbytes:
        raise BadCacheError(TRUNCATED, f"block {ref.name} has {len(blob)} bytes, manifest says {ref.nbytes}")
    if (crc32(blob) if crc is None else crc) != ref.crc32:
        raise BadCacheError(CHECKSUM, f"block {ref.name} fails its CRC-32")
    spec = manifest.spec
    try:
        metadata, entries, data_start = parse_header(blob)
    except SafetensorsError as exc:
        raise BadCacheError(BAD_BLOCK, f"block {ref.name}: {exc}") from None
    expected_meta = _block_metadata(spec, manifest.quantization, manifest.group_size, ref.n_tokens)
    if not spec.all_full_attention:
        return layered_codec.decode_layered(
            blob,
            ref.name,
            ref.n_tokens,
            spec,
            manifest.quantization,
            manifest.group_size,
            metadata,
            expected_meta,
            entries,
            data_start,
        )
    if metadata != expected_meta:
        raise BadCacheError(BAD_BLOCK, f"block {ref.name} metadata {metadata} is not {expected_meta}")
    expected = _expected_tensors(spec, manifest.quantization, manifest.group_size, ref.n_tokens)
    got = {name: (e.dtype, e.shape) for name, e in entries.items()}
    if got != expected:
        raise BadCacheError(BAD_BLOCK, f"block {ref.name} holds other tensors than expected")
    if manifest.quantization == "none":
        keys = tuple(view(blob, entries[f"L{i}.k"], data_start) for i in range(spec.n_layers))
        values = tuple(view(blob, entries[f"L{i}.v"], data_start) for i in range(spec.n_layers))
        return KVBlock(keys=keys, values=values)
    # Quantized blocks come back as they are stored (views): a pool quantized the same way takes
    # them as they are, any other converts the agent's cache once (engine/kv/quantized.py).
    parts = {
        (kind, part): tuple(
            view(blob, entries[f"L{i}.{kind}.{part}"], data_start) for i in range(spec.n_layers)
        )
        for kind in ("k", "v")
        for part in ("q", "scales", "biases")
    }
    quant_parts = QuantParts(
        quant.QUANT_BITS[manifest.quantization],
        manifest.group_size,
        parts["k", "scales"],
        parts["k", "biases"],
        parts["v", "scales"],
        parts["v", "biases"],
    )
    return KVBlock(keys=parts["k", "q"], values=parts["v", "q"], quant=quant_parts)


def _expected_tensors(
    spec: ModelCacheSpec, quantization: str, group_size: int, n_tokens: int
) -> dict[str, tuple[str, tuple[int, ...]]]:
    dtype = _ST_DTYPE[spec.dtype]
    heads = spec.n_kv_heads
    expected: dict[str, tuple[str, tuple[int, ...]]] = {}
    for layer in range(spec.n_layers):
        for kind, dim in (("k", spec.k_head_dim), ("v", spec.v_head_dim)):
            if quantization == "none":
                expected[f"L{layer}.{kind}"] = (dtype, (heads, n_tokens, dim))
                continue
            bits = quant.QUANT_BITS[quantization]
            expected[f"L{layer}.{kind}.q"] = ("U32", (heads, n_tokens, dim * bits // 32))
            expected[f"L{layer}.{kind}.scales"] = (dtype, (heads, n_tokens, dim // group_size))
            expected[f"L{layer}.{kind}.biases"] = (dtype, (heads, n_tokens, dim // group_size))
    return expected


def _full_precision(block: KVBlock, spec: ModelCacheSpec) -> KVBlock:
    """`block` at full precision. A quantized block comes only from a worker's quantized pool, and the
    conversion runs on MLX: imported here, so reading a store (`kvrq cache`, `kvrq agent`) never loads it."""
    if block.quant is None:
        return block
    from engine.kv.quantized import dequantize_block

    return dequantize_block(block, spec)
