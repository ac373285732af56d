"""The manifest: the one small blob that makes a stored cache exist (format: docs/store-format.md).

It is a safetensors blob whose only tensor is `token_ids` (int64) and whose metadata
holds the format version, the spec and its fingerprint, the quantization and the list
of blocks with their CRC-32s. It is written last and swapped in atomically, so a
reader sees either the previous complete cache or the new complete one. The metadata
carries a CRC-32 of itself and of the token ids, so a flipped byte anywhere in it is
caught before any block is read.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import uuid
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.core.spec import ModelCacheSpec
from store.errors import AGENT_MISMATCH, BAD_MANIFEST, FORMAT_VERSION, SPEC_MISMATCH, BadCacheError
from store.stfile import SafetensorsError, TensorEntry, encode, parse_header, view

FORMAT_NAME = "kvrq-agent-cache"
# Manifests: version 2 adds `fence` and `part_bytes` (blocks split into several Redis values). A version-1
# reader must not take a version-2 Redis cache for a damaged one and delete it, hence the bump; version-1
# manifests still read (fence 0, one value per block). Version 3: the spec describes each layer (sliding
# windows, per-layer shapes, SSM state) and such models' blocks follow store/layered_codec.py; a plain
# full-attention model's spec, fingerprint and blocks did not change, so its version-1 and -2 caches still
# read, and an older reader takes a version-3 cache for a miss (format_version) and leaves it alone.
# Version 4: full blocks are shared by the agents of a namespace (names `<share>.<crc32>`, stored where
# every agent finds them: Redis `<prefix>s:<name>`, disk `shared/` plus a hard link per agent); a
# version-3 reader would look for them under the agent and delete the cache as damaged.
# Version 5: a manifest may carry a second tensor, `conversation` (uint8: the worker's JSON record of the
# agent's messages, written with its KV as one unit); a version-4 reader would call it damaged.
FORMAT_VERSION_NUMBER = 5
READABLE_VERSIONS = ("1", "2", "3", "4", "5")
BLOCK_FORMAT_VERSION = 1


@dataclass(frozen=True)
class BlockRef:
    """What the manifest records about one stored block."""

    name: str  # storage name: chain hash + writing generation, [0-9a-f.] only
    chain: str  # reuse key: hash of spec, quantization and every token up to the block's end
    n_tokens: int
    nbytes: int
    crc32: int


@dataclass(frozen=True)
class Manifest:
    agent_id: str
    spec: ModelCacheSpec
    quantization: str
    group_size: int
    token_ids: np.ndarray  # int64, one per cached token
    blocks: tuple[BlockRef, ...]
    generation: str  # unique per put: tells a reader a concurrent rewrite from a broken cache
    created: float
    fence: int = 0  # the writer's fencing token: a put with a lower one is dropped as stale
    part_bytes: int = 0  # blocks are stored as values of at most this many bytes; 0: one value per block
    namespace: str = ""  # the writing store's namespace, whose shared area holds its full blocks
    conversation: bytes | None = None  # opaque to the store (AgentCache.conversation)

    @property
    def n_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def block_bytes(self) -> int:
        return sum(ref.nbytes for ref in self.blocks)


def new_generation() -> str:
    """A unique id for one put: 128 random bits (a process prefix + a counter would repeat
    across machines sharing a Redis; a random id does not)."""
    return uuid.uuid4().hex


@functools.lru_cache(maxsize=64)
def spec_fingerprint(spec: ModelCacheSpec) -> str:
    """spec.fingerprint(), computed once per spec (it serializes the whole spec each call)."""
    return spec.fingerprint()


def chain_keys(
    spec: ModelCacheSpec,
    quantization: str,
    group_size: int,
    token_ids: Sequence[int],
    layouts: Sequence[str] = (),
) -> list[str]:
    """One reuse key per block: equal keys mean equal tokens from position 0 to the block's end
    and, where a block's layout is not '' (engine.core.blocks.KVBlock.layout: a sliding window's part,
    a checkpoint), the same layout."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    digest = hashlib.sha256(f"{spec_fingerprint(spec)}|{quantization}|{group_size}|".encode())
    keys = []
    for index, start in enumerate(range(0, len(tokens), spec.block_tokens)):
        digest.update(tokens[start : start + spec.block_tokens].tobytes())
        key = digest.copy()
        layout = layouts[index] if index < len(layouts) else ""
        if layout:
            key.update(f"|{layout}".encode())
        keys.append(key.hexdigest()[:32])
    return keys


def block_name(chain: str, generation: str) -> str:
    """An agent's own block: `{chain[:24]}.{generation[:12]}`, rewritten under a new name by every put."""
    return f"{chain[:24]}.{generation[:12]}"


def share_keys(chains: Sequence[str], namespace: str, part_bytes: int) -> list[str]:
    """Content keys of full blocks, shared by every agent of `namespace` with the same tokens so far.

    `chains` already cover the spec, quantization and every token up to each block's end;
    `part_bytes` is in the key because it fixes how a block is laid out in storage.
    """
    salt = hashlib.sha256(f"{namespace}|{part_bytes}|".encode()).hexdigest()
    return [hashlib.sha256(f"{salt}|{chain}".encode()).hexdigest()[:32] for chain in chains]


def shared_name(share: str, crc32: int) -> str:
    """A shared block's name: its content key and the CRC-32 of its bytes (one name per version)."""
    return f"{share}.{crc32:08x}"


def parse_shared_name(name: str) -> tuple[str, int] | None:
    """(share key, CRC-32) of a shared block's name; None for an agent's own block."""
    share, dot, crc = name.partition(".")
    if dot and len(share) == 32 and len(crc) == 8 and _hex(share) and _hex(crc):
        return share, int(crc, 16)
    return None


def _hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


def encode_manifest(manifest: Manifest) -> bytes:
    tokens = np.ascontiguousarray(manifest.token_ids, dtype=np.int64)
    metadata = {
        "format": FORMAT_NAME,
        "version": str(FORMAT_VERSION_NUMBER),
        "kind": "manifest",
        "agent_id": manifest.agent_id,
        "model_name": manifest.spec.model_name,
        "spec": json.dumps(manifest.spec.to_dict(), sort_keys=True),
        "fingerprint": spec_fingerprint(manifest.spec),
        "dtype": manifest.spec.dtype,
        "quantization": manifest.quantization,
        "group_size": str(manifest.group_size),
        "n_tokens": str(manifest.n_tokens),
        "blocks": json.dumps([[b.name, b.chain, b.n_tokens, b.nbytes, b.crc32] for b in manifest.blocks]),
        "generation": manifest.generation,
        "created": repr(manifest.created),
        "fence": str(manifest.fence),
        "part_bytes": str(manifest.part_bytes),
        "namespace": manifest.namespace,
        "tokens_crc32": str(zlib.crc32(tokens.data)),
    }
    tensors: list[tuple[str, str, np.ndarray]] = [("token_ids", "I64", tokens)]
    if manifest.conversation is not None:
        conversation = np.frombuffer(manifest.conversation, dtype=np.uint8)
        metadata["conversation_crc32"] = str(zlib.crc32(manifest.conversation))
        tensors.append(("conversation", "U8", conversation))
    metadata["checksum"] = str(_metadata_checksum(metadata))
    header, buffers = encode(tensors, metadata)
    return b"".join([header, *buffers])


def _metadata_checksum(metadata: dict[str, str]) -> int:
    body = {k: v for k, v in metadata.items() if k != "checksum"}
    return zlib.crc32(json.dumps(body, sort_keys=True).encode())


def read_format(metadata: dict[str, str]) -> None:
    """Raise BadCacheError unless the metadata is this store's format, at this version."""
    if metadata.get("format") != FORMAT_NAME:
        raise BadCacheError(BAD_MANIFEST, f"not a {FORMAT_NAME} blob (format {metadata.get('format')!r})")
    if metadata.get("version") not in READABLE_VERSIONS:
        raise BadCacheError(
            FORMAT_VERSION,
            f"format version {metadata.get('version')!r}, this store reads {', '.join(READABLE_VERSIONS)}",
        )


def _checked_header(
    blob: bytes | bytearray | memoryview,
) -> tuple[dict[str, str], dict[str, TensorEntry], int]:
    """parse_header of a manifest of this format and version whose metadata passes its checksum."""
    try:
        metadata, entries, data_start = parse_header(blob)
    except SafetensorsError as exc:
        raise BadCacheError(BAD_MANIFEST, str(exc)) from None
    read_format(metadata)
    if metadata.get("kind") != "manifest" or metadata.get("checksum") != str(_metadata_checksum(metadata)):
        raise BadCacheError(BAD_MANIFEST, "manifest metadata fails its checksum")
    return metadata, entries, data_start


def decode_manifest(blob: bytes | bytearray | memoryview, agent_id: str, spec: ModelCacheSpec) -> Manifest:
    """The manifest in `blob`, checked to be intact, for `agent_id`, and made for `spec`.

    Raises BadCacheError with reason bad_manifest, format_version, agent_mismatch or
    spec_mismatch.
    """
    metadata, entries, data_start = _checked_header(blob)
    entry = entries.get("token_ids")
    if entry is None or entry.dtype != "I64" or len(entry.shape) != 1:
        raise BadCacheError(BAD_MANIFEST, "manifest has no int64 token_ids vector")
    tokens = view(blob, entry, data_start)
    if str(zlib.crc32(tokens.data)) != metadata.get("tokens_crc32"):
        raise BadCacheError(BAD_MANIFEST, "token ids fail their checksum")
    conversation = _conversation(blob, entries, data_start, metadata)
    if metadata.get("agent_id") != agent_id:
        raise BadCacheError(AGENT_MISMATCH, f"manifest belongs to agent {metadata.get('agent_id')!r}")
    if metadata.get("fingerprint") != spec_fingerprint(spec):
        raise BadCacheError(
            SPEC_MISMATCH,
            f"cache made for {metadata.get('model_name')!r} spec {metadata.get('fingerprint')}, "
            f"this store serves {spec.model_name!r} spec {spec_fingerprint(spec)}",
        )
    try:
        return dataclasses.replace(_build(metadata, tokens, agent_id, spec), conversation=conversation)
    except (KeyError, TypeError, ValueError) as exc:
        raise BadCacheError(BAD_MANIFEST, f"manifest fields are inconsistent: {exc}") from None


def _conversation(
    blob: bytes | bytearray | memoryview,
    entries: dict[str, TensorEntry],
    data_start: int,
    metadata: dict[str, str],
) -> bytes | None:
    """The manifest's conversation bytes (None when it has none), checked against their CRC-32."""
    extra = set(entries) - {"token_ids", "conversation"}
    if extra:
        raise BadCacheError(BAD_MANIFEST, f"manifest has unexpected tensors {sorted(extra)}")
    entry = entries.get("conversation")
    if entry is None:
        return None
    if entry.dtype != "U8" or len(entry.shape) != 1:
        raise BadCacheError(BAD_MANIFEST, "manifest's conversation is not a byte vector")
    data = view(blob, entry, data_start).tobytes()
    if str(zlib.crc32(data)) != metadata.get("conversation_crc32"):
        raise BadCacheError(BAD_MANIFEST, "the conversation fails its checksum")
    return data


def _build(metadata: dict[str, str], tokens: np.ndarray, agent_id: str, spec: ModelCacheSpec) -> Manifest:
    stored_spec = ModelCacheSpec.from_dict(json.loads(metadata["spec"]))
    if stored_spec != spec:
        raise ValueError("spec does not match its fingerprint")
    quantization = metadata["quantization"]
    if quantization not in ("none", "q8", "q4"):
        raise ValueError(f"unknown quantization {quantization!r}")
    raw_blocks: Any = json.loads(metadata["blocks"])
    blocks = tuple(
        BlockRef(str(name), str(chain), int(n), int(size), int(crc))
        for name, chain, n, size, crc in raw_blocks
    )
    if not all(_safe_name(b.name) for b in blocks):
        raise ValueError("a block name has unsafe characters")
    if sum(b.n_tokens for b in blocks) != tokens.shape[0] or int(metadata["n_tokens"]) != tokens.shape[0]:
        raise ValueError("blocks do not cover the token ids")
    for index, ref in enumerate(blocks):
        full = ref.n_tokens == spec.block_tokens
        if not (full or (index == len(blocks) - 1 and 0 < ref.n_tokens < spec.block_tokens)):
            raise ValueError(f"block {index} holds {ref.n_tokens} tokens")
    return Manifest(
        agent_id=agent_id,
        spec=spec,
        quantization=quantization,
        group_size=int(metadata["group_size"]),
        token_ids=tokens,
        blocks=blocks,
        generation=metadata["generation"],
        created=float(metadata["created"]),
        fence=_fence(metadata),
        part_bytes=_part_bytes(metadata),
        namespace=metadata.get("namespace", ""),
    )


def _part_bytes(metadata: dict[str, str]) -> int:
    """How the blocks are cut into stored values (absent before version 2: one value per block)."""
    part_bytes = int(metadata.get("part_bytes", "0"))
    if part_bytes < 0:
        raise ValueError(f"negative part_bytes {part_bytes}")
    return part_bytes


def part_sizes(nbytes: int, part_bytes: int) -> list[int]:
    """The sizes of the values a block of `nbytes` is stored as: consecutive byte ranges of its blob."""
    if part_bytes <= 0 or nbytes <= part_bytes:
        return [nbytes]
    full, rest = divmod(nbytes, part_bytes)
    return [part_bytes] * full + ([rest] if rest else [])


def _fence(metadata: dict[str, str]) -> int:
    """The manifest's fencing token; manifests written before fencing existed hold none: 0."""
    fence = int(metadata.get("fence", "0"))
    if fence < 0:
        raise ValueError(f"negative fence {fence}")
    return fence


def stored_fence(blob: bytes | bytearray | memoryview | None) -> int:
    """The fence of the manifest in `blob` (any spec); 0 when there is none or it is unreadable.

    A damaged manifest forgets its fence: the next put of any fence replaces it.
    """
    if blob is None:
        return 0
    try:
        return summarize_manifest(blob).fence
    except BadCacheError:
        return 0


def _safe_name(name: str) -> bool:
    return 0 < len(name) <= 64 and all(c in "0123456789abcdef." for c in name) and not name.startswith(".")


@dataclass(frozen=True)
class ManifestSummary:
    """What listing and budgets need from a manifest, whatever model or spec made it."""

    agent_id: str
    n_tokens: int
    block_bytes: int
    n_blocks: int
    quantization: str
    fingerprint: str
    blocks: tuple[tuple[str, int], ...]  # (name, nbytes) of each block whose name is safe
    fence: int
    part_bytes: int
    namespace: str  # "" for a manifest written before the namespace was recorded


def summarize_manifest(blob: bytes | bytearray | memoryview) -> ManifestSummary:
    """Summary of an intact manifest of this format; BadCacheError otherwise."""
    metadata, _entries, _start = _checked_header(blob)
    try:
        raw_blocks: Any = json.loads(metadata["blocks"])
        return ManifestSummary(
            agent_id=metadata["agent_id"],
            n_tokens=int(metadata["n_tokens"]),
            block_bytes=sum(int(entry[3]) for entry in raw_blocks),
            n_blocks=len(raw_blocks),
            quantization=metadata["quantization"],
            fingerprint=metadata["fingerprint"],
            blocks=tuple((str(entry[0]), int(entry[3])) for entry in raw_blocks if _safe_name(str(entry[0]))),
            fence=_fence(metadata),
            part_bytes=_part_bytes(metadata),
            namespace=metadata.get("namespace", ""),
        )
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise BadCacheError(BAD_MANIFEST, f"manifest fields are inconsistent: {exc}") from None
