"""RaggedBatchGenerator: continuous batching where every sequence keeps its own KV buffers.

mlx-lm's BatchGenerator keeps the batch's KV in one left-padded tensor: a sequence
joining with a long cache pads every batch mate to its length (a copy of the whole
batch), and from then on every row attends over that padding: 8 short rows joined by
one 1.7K-token row decoded 3.1x slower per step. Here each row owns its layers'
(1, heads, capacity, dim) buffers (plain mlx-lm KVCaches, grown in 256-token steps),
except short decoding rows, which sit side by side in the ShortSlots (engine/batch/short_slots.py),
and each step is ONE forward pass over a flat batch of tokens:

- every decoding row contributes its one next token, rows still in their prompt a chunk
  of it, all laid out as a (tokens, 1) batch: the projections and MLP run once over all
  of them (the weights, which dominate a step's memory traffic, are read once), each
  token carries its own position for rope, and attention runs per row over that row's
  own length (FlatLayerCache routes the model's scaled_dot_product_attention to one
  call per long row and one for all the short ones), so nobody reads a long row's padding
  and nobody waits for a separate prefill pass;
- joining copies nothing: a row's buffers were filled by the gather of its saved blocks;
  a warm agent's short suffix rides in the next step and its first token comes out of it;
- prompt tokens per step are bounded (`prefill_tokens_per_step`), shortest remaining
  prefill first: a warm agent's suffix is never stuck behind a burst of long cold
  prompts, and the first of a burst finish after their own prefill, not the whole
  burst's; a step in which a prompt finishes carries no chunk of an unfinished one (at
  most every other step), so a warm agent's first token comes from a short step; a burst of
  warm suffixes is finished over several steps, as many tokens a step as the learnt step cost
  says minimises their mean first token, or the first step the burst's shortest half where that
  costs the mean little and saves its median a step (engine/batch/step_cost.py);
  decoding rows get a token every step whatever is being prefilled;
- a decoding row may carry a prompt-lookup draft after its token (engine/batch/speculation.py):
  its 1 + k tokens run like a prefill chunk, the verified ones are kept and the caches trimmed
  back over the rest;
- on the CPU, a flat batch of 10-16 tokens runs as 16 rows and 20-31 as 32, OpenBLAS's fast
  matmul shapes (engine/cpu/gemm_rows.py): the extra rows attend to nothing, write no K/V and are
  never sampled.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from engine.batch import acceleration
from engine.batch.attention import AttentionCall, QuantizedCall, fused_attention
from engine.batch.sampling import Sampler, allowed_draft, ends_row, token_logprobs
from engine.batch.short_slots import SHORT_ROW_TOKENS, ShortSlots, SlotStep
from engine.batch.speculation import RowSpeculation, Speculation, accept_greedy
from engine.batch.split_choice import Key, SplitChoice
from engine.batch.state_rows import FlatCacheList, FlatStateCache, route_state_mixers
from engine.batch.step_cost import StepCost
from engine.core.params import LogitsProcessor
from engine.core.results import TokenLogprobs
from engine.kv.window import WindowKVCache

# Model modules whose attention goes through base.scaled_dot_product_attention with
# rope(offset=cache.offset) and cache.update_and_fetch, whose masks come from the cache's
# make_mask, and whose logits are its body then its head (body_and_head): checked by tests on tiny models
# (tests/engine/test_families.py). The rest run on mlx-lm's BatchGenerator (engine/batch/backends.py).
SUPPORTED_MODULES = frozenset(
    {
        "mlx_lm.models.llama",
        "mlx_lm.models.qwen2",
        "mlx_lm.models.qwen3",
        "mlx_lm.models.mixtral",
        "mlx_lm.models.qwen3_moe",
        "mlx_lm.models.phi3",
        # sliding-window layers (WindowKVCache per row; gpt_oss with attention sinks)
        "mlx_lm.models.gemma3_text",
        "mlx_lm.models.gpt_oss",
        "mlx_lm.models.ministral3",
        # per-layer head counts (no ShortSlots: they hold one head count for all layers)
        "mlx_lm.models.openelm",
        # MLA expanded to heads (K and V dims differ): plain attention to the ragged step
        "mlx_lm.models.deepseek_v2",
        # MLA over the latent cache (LATENT_MODULES), no ShortSlots
        "mlx_lm.models.deepseek_v3",
        # SSM / linear-attention state per row (engine/batch/state_rows.py), no ShortSlots
        "mlx_lm.models.mamba",
        "mlx_lm.models.mamba2",
        "mlx_lm.models.qwen3_next",
        "mlx_lm.models.qwen3_5",
        "mlx_lm.models.falcon_h1",
    }
)

# Modules whose attention lives in another module (qwen3_5 imports qwen3_next's): routed too.
ATTENTION_FROM = {"mlx_lm.models.qwen3_5": ("mlx_lm.models.qwen3_next",)}
# Modules whose logits are not head(body(...)) by body_and_head's rule (falcon_h1 scales tied logits;
# qwen3_5 nests its language model): the step runs the whole model and projects every token.
WHOLE_MODEL = frozenset({"mlx_lm.models.falcon_h1", "mlx_lm.models.qwen3_5"})

# Modules whose attention caches MLA's latent and rope key (keys: (1, 1, n, kv_lora_rank), values:
# (1, 1, n, rope_dim)) and scores the rope part itself: it computes (q_pe * scale) @ k_pe^T and hands
# that to attention as its additive mask. FlatLayerCache gives such a layer an identity for k_pe, so
# the "mask" it gets back is each token's scaled q_pe, and scores each row against its own k_pe.
LATENT_MODULES = frozenset({"mlx_lm.models.deepseek_v3"})


class FlatLayerCache:
    """One layer's view of a step: rows' token runs laid out as a (tokens, 1) batch.

    `offset` gives every token its own rope position. The first `slot_step.size` tokens
    belong to the short rows in the ShortSlots (written by one scatter, attended in one
    masked call); every other run's K/V go into its row's own KVCache and it attends
    alone over its own length (causal within a run of several tokens). A sliding-window layer's
    rows are WindowKVCaches, which fetch only their window and give the run's mask; the slotted
    rows then attend under `slot_mask` (each row's window of the slots) when the slots are wider.
    """

    def __init__(
        self,
        rows: list[Any],
        run_lengths: list[int],
        positions: mx.array,
        slots: ShortSlots,
        slot_step: SlotStep | None,
        layer: int,
        padding: int = 0,
        slot_mask: mx.array | None = None,
        latent: bool = False,
    ) -> None:
        self.rows = rows
        self.run_lengths = run_lengths
        self.offset = positions  # (tokens,): what the model hands to rope
        self.slots = slots
        self.slot_step = slot_step
        self.layer = layer
        self.skip = slot_step.size if slot_step is not None else 0
        self.padding = padding  # trailing rows of the flat batch that belong to nobody
        self.slot_mask = slot_mask
        self.latent = latent  # MLA over a latent cache (LATENT_MODULES): see latent_attention
        bounds, total = [], 0
        for n in run_lengths[:-1]:
            total += n
            bounds.append(total)
        self._bounds = bounds
        self._fetched: list[tuple[mx.array, mx.array]] = []

    def _runs(self, flat: mx.array) -> list[mx.array]:
        """(tokens, heads, 1, dim) past the slotted rows -> one (1, heads, run, dim) array per
        row (a run of one token is already that shape: no extra op, at a few µs per op)."""
        if not self.rows:
            return []
        if self.skip or self.padding:
            flat = flat[self.skip : flat.shape[0] - self.padding]
        parts = mx.split(flat, self._bounds, axis=0) if self._bounds else [flat]
        return [
            part if n == 1 else part.swapaxes(0, 2) for part, n in zip(parts, self.run_lengths, strict=True)
        ]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.slot_step is not None:
            self.slots.write(self.layer, self.slot_step, keys[: self.skip], values[: self.skip])
        self._fetched = [
            row.update_and_fetch(k, v)
            for row, k, v in zip(self.rows, self._runs(keys), self._runs(values), strict=True)
        ]
        if self.latent:  # the model's (q_pe * scale) @ k_pe^T becomes q_pe * scale: see LATENT_MODULES
            return keys, identity(int(values.shape[-1]), values.dtype)
        return keys, values  # placeholders: attention reads the slots and self._fetched

    def make_mask(self, *args: Any, **kwargs: Any) -> None:
        return None  # attention is per row (FlatLayerCache.attend)

    def attend(
        self, queries: mx.array, scale: float, sinks: mx.array | None, mask: mx.array | None = None
    ) -> mx.array:
        """Every run's attention output as the flat batch's (tokens, heads, 1, dim); `mask` is
        the model's only for a latent layer (its tokens' scaled q_pe), else None (make_mask)."""
        if self.latent:
            if mask is None or self.slot_step is not None:
                raise RuntimeError("a latent layer needs its q_pe and rows of its own (no ShortSlots)")
            return self._latent_attend(queries, mask, scale)
        calls = []
        quantized: list[QuantizedCall] = []  # rows of a pool with kv_bits: their caches hand back packed K/V
        if self.slot_step is not None:
            call = self.slots.attention_call(self.layer, self.slot_step, queries[: self.skip])
            if self.slot_mask is not None:
                call = dataclasses.replace(call, mask=self.slot_mask, prefix_lengths=None)
            calls.append(call)
        runs = zip(self.rows, self._runs(queries), self._fetched, self.run_lengths, strict=True)
        for row, q, (k, v), n in runs:
            run_mask = row.mask() if isinstance(row, WindowKVCache) else None if n == 1 else "causal"
            if isinstance(k, tuple):
                quantized.append(QuantizedCall(q, k, v, row.bits, row.group_size, run_mask))
            else:
                calls.append(AttentionCall(q, k, v, mask=run_mask))
        if calls and quantized:
            raise RuntimeError("a step mixes quantized and full-precision rows")
        if quantized:
            outputs = acceleration.attend_quantized(quantized, scale, sinks)
        else:
            outputs = attend_with_windows(calls, scale, sinks)
        first_run = 0 if self.slot_step is None else 1
        for i, n in enumerate(self.run_lengths, start=first_run):
            if n > 1:  # (1, heads, n, dim) -> the flat batch's (n, heads, 1, dim)
                outputs[i] = outputs[i].swapaxes(0, 2)
        self._fetched = []
        if self.padding:  # padding rows attend to nothing: zeros, never read by anybody
            outputs.append(padding_output((self.padding, *outputs[0].shape[1:]), outputs[0].dtype))
        return mx.concatenate(outputs, axis=0) if len(outputs) > 1 else outputs[0]

    def _latent_attend(self, queries: mx.array, scaled_q_pe: mx.array, scale: float) -> mx.array:
        """MLA per row, as mlx-lm's deepseek_v3 runs a one-token step: the absorbed queries attend
        over the row's latent (keys = values), with the rope part's scores (each run's scaled q_pe
        against the row's own k_pe, causal within a run) added as the mask."""
        outputs = []
        runs = zip(self._runs(queries), self._runs(scaled_q_pe), self._fetched, self.run_lengths, strict=True)
        for q, q_pe, (latent, k_pe), n in runs:
            pe_scores = q_pe @ k_pe.swapaxes(-1, -2)
            if n > 1:
                held = int(latent.shape[2])
                causal = mx.arange(held - n, held)[:, None] >= mx.arange(held)[None]
                pe_scores = mx.where(
                    causal, pe_scores, mx.array(mx.finfo(pe_scores.dtype).min, pe_scores.dtype)
                )
            out = mx.fast.scaled_dot_product_attention(q, latent, latent, scale=scale, mask=pe_scores)
            outputs.append(out if n == 1 else out.swapaxes(0, 2))
        self._fetched = []
        if self.padding:
            outputs.append(padding_output((self.padding, *outputs[0].shape[1:]), outputs[0].dtype))
        return mx.concatenate(outputs, axis=0) if len(outputs) > 1 else outputs[0]


def attend_with_windows(calls: list[AttentionCall], scale: float, sinks: mx.array | None) -> list[mx.array]:
    """acceleration.attend, except for runs whose window cuts their keys (a (queries, keys) mask
    array: a prompt chunk of a sliding layer past its window), which go to MLX's fused call: the
    CPU path lays the query heads of a KV head out in one axis, which such a mask does not fit."""
    windowed = [i for i, c in enumerate(calls) if isinstance(c.mask, mx.array) and c.mask.ndim == 2]
    if not windowed:
        return acceleration.attend(calls, scale, sinks)
    rest = [i for i in range(len(calls)) if i not in set(windowed)]
    outputs: list[mx.array] = [mx.array(0)] * len(calls)
    for i, out in zip(windowed, fused_attention([calls[i] for i in windowed], scale, sinks), strict=True):
        outputs[i] = out
    if rest:
        for i, out in zip(rest, acceleration.attend([calls[i] for i in rest], scale, sinks), strict=True):
            outputs[i] = out
    return outputs


@functools.lru_cache(maxsize=8)
def identity(size: int, dtype: mx.Dtype) -> mx.array:
    """(1, 1, size, size): what a latent layer hands the model for k_pe (see LATENT_MODULES)."""
    return mx.eye(size, dtype=dtype)[None, None]


@functools.lru_cache(maxsize=16)
def padding_output(shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
    """The padding rows' attention output: one array per shape, shared by every layer and
    step (MLX arrays are immutable), instead of a new one per layer."""
    return mx.zeros(shape, dtype=dtype)


def route_attention(model: Any) -> bool:
    """Make the model's module send attention over a FlatLayerCache to it (and its SwiGLU
    through engine/cpu/numpy_exp.py), once per module.

    Every other cache goes to mlx-lm's own function unchanged. False when the model's
    architecture is not one this routing is known to be right for.
    """
    module_name = type(model).__module__
    if module_name not in SUPPORTED_MODULES:
        return False
    route_state_mixers(module_name)
    for name in (module_name, *ATTENTION_FROM.get(module_name, ())):
        _route_module(sys.modules[name])
    return True


def _route_module(module: Any) -> None:
    original = getattr(module, "scaled_dot_product_attention", None)
    if original is None or getattr(original, "_kvrq_routed", False):
        return  # no attention (mamba), or routed already

    def scaled_dot_product_attention(
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        cache: Any,
        scale: float,
        mask: Any,
        sinks: mx.array | None = None,
    ) -> mx.array:
        if isinstance(cache, FlatLayerCache):
            return cache.attend(queries, scale, sinks, mask if cache.latent else None)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    scaled_dot_product_attention._kvrq_routed = True  # type: ignore[attr-defined]
    module.scaled_dot_product_attention = scaled_dot_product_attention
    acceleration.route_swiglu(module)


def body_and_head(model: Any) -> tuple[Any, Any] | None:
    """The model's layers up to the final norm (`model.model`; OpenELM's `model.transformer`, mamba's
    `model.backbone`) and its vocabulary projection: its lm_head, or the embeddings where it has none
    (tied: mlx-lm leaves lm_head out). Every SUPPORTED_MODULES model's logits are exactly
    head(body(...)), except WHOLE_MODEL's (None)."""
    if type(model).__module__ in WHOLE_MODEL:
        return None
    body = next(
        b for b in (getattr(model, n, None) for n in ("model", "transformer", "backbone")) if b is not None
    )
    head = getattr(model, "lm_head", None)
    if head is None:
        embeddings = next(
            e
            for e in (getattr(body, n, None) for n in ("embed_tokens", "token_embeddings", "embeddings"))
            if e is not None
        )
        head = embeddings.as_linear
    return body, head


def layer_kinds(model: Any) -> list[Any]:
    """Per layer of the model's cache list: "kv", "state" (an ArraysCache), or the list of its
    members' kinds (a CacheList)."""
    from mlx_lm.models.cache import ArraysCache, CacheList, make_prompt_cache

    def kind(cache: Any) -> Any:
        if isinstance(cache, CacheList):
            return [kind(member) for member in cache.caches]
        return "state" if isinstance(cache, ArraysCache) else "kv"

    return [kind(cache) for cache in make_prompt_cache(model)]


def layer_arrays(layer: Any) -> list[Any]:
    """The arrays a row's layer cache holds (what a step writes), whatever its kind."""
    from mlx_lm.models.cache import ArraysCache, CacheList

    if isinstance(layer, CacheList):
        return [a for member in layer.caches for a in layer_arrays(member)]
    if isinstance(layer, ArraysCache):
        return [a for a in layer.cache if a is not None]
    return [a for a in (layer.keys, layer.values) if a is not None]


def layer_windows(model: Any) -> list[int | None]:
    """Each layer's sliding window (a RotatingKVCache's size in the model's own cache list), or None."""
    from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

    return [
        int(cache.max_size) if isinstance(cache, RotatingKVCache) else None
        for cache in make_prompt_cache(model)
    ]


def verified(rows: list[Row], values: list[int]) -> list[tuple[int, list[int]]]:
    """Each row's tokens from the step's greedy picks, in order (a drafted row's k + 1 of them):
    one for a plain row, the accepted drafts and the model's token after them for a drafted one."""
    out, at = [], 0
    for row in rows:
        if row.drafting:
            n = len(row.pending)
            out.append((row.uid, accept_greedy(row.pending[1:], values[at : at + n])))
            at += n
        else:
            out.append((row.uid, values[at : at + 1]))
            at += 1
    return out


def holds_all(row: Any) -> bool:
    """Whether every layer of the row holds its tokens from position 0: what the ShortSlots copy in
    (a sliding layer's WindowKVCache may have dropped the tokens before its window)."""
    return all(getattr(layer, "first", 0) == 0 for layer in row.layers)


def slot_window_masks(step: SlotStep | None, windows: list[int | None]) -> dict[int | None, mx.array]:
    """For each window narrower than the slots' width this step: each slotted row's last `window`
    positions, as a (size, 1, 1, width) mask (its tokens end at its length)."""
    if step is None:
        return {}
    out: dict[int | None, mx.array] = {}
    lengths = mx.array(step.lengths)[:, None]
    positions = mx.arange(step.width)[None, :]
    for window in {w for w in windows if w is not None and w < step.width}:
        mask = (positions < lengths) & (positions >= lengths - window)
        out[window] = mask[:, None, None, :]
    return out


@dataclass
class Row:
    uid: int
    layers: list[Any]  # one mlx-lm KVCache per layer, owned by this row
    cached_tokens: list[int]  # the tokens whose K/V the layers hold, in order
    pending: list[int]  # tokens not yet fed: the prompt's rest, then the last sampled token
    max_tokens: int
    sampler: Sampler | None
    stop_token_ids: frozenset[int]
    inserted_step: int
    sampled: list[int] = field(default_factory=list)
    processors: list[LogitsProcessor] = field(default_factory=list)  # this row's own, mlx-lm's signature
    top_logprobs: int | None = None  # None: no logprobs; else how many best tokens besides the chosen
    ended: bool = False  # a processor ended the row on its last token
    speculation: RowSpeculation | None = None  # drafts from its context (engine/batch/speculation.py)
    draft_masks: np.ndarray | None = None  # a drafted grammar row's allowed tokens, per position this step

    @property
    def plain(self) -> bool:
        """Greedy with nothing to process or report: the batch's one shared argmax serves it."""
        return self.sampler is None and not self.processors and self.top_logprobs is None

    @property
    def length(self) -> int:
        """Tokens whose K/V the row holds (in its slot or its own layers)."""
        return len(self.cached_tokens)

    @property
    def decoding(self) -> bool:
        return bool(self.sampled)

    @property
    def drafting(self) -> bool:
        """Decoding with draft tokens after its last one this step (speculation)."""
        return bool(self.sampled) and len(self.pending) > 1

    @property
    def finished(self) -> bool:
        return bool(self.sampled) and (
            self.ended or len(self.sampled) >= self.max_tokens or self.sampled[-1] in self.stop_token_ids
        )


@dataclass(frozen=True)
class RowToken:
    uid: int
    token: int
    finish_reason: str | None  # "stop" (a stop token), "length" (max_tokens), None
    logprobs: TokenLogprobs | None = None  # when the row asked for them


@dataclass
class StepStats:
    prompt_tokens: int = 0  # prompt tokens fed this step
    decode_rows: int = 0
    forward_s: float = 0.0
    step_s: float = 0.0  # the whole step: drafting, the slots' moves, the forward, the verify
    draft_tokens: int = 0  # draft tokens verified this step (speculation)
    accepted_tokens: int = 0  # of which accepted


class RaggedBatchGenerator:
    def __init__(self, model: Any, *, prefill_tokens_per_step: int = 256, short_slots: bool = True) -> None:
        """`short_slots=False` keeps every decoding row in its own caches (rows whose caches are
        quantized: the ShortSlots hold full-precision K/V only)."""
        if prefill_tokens_per_step <= 0:
            raise ValueError(f"prefill_tokens_per_step must be positive, got {prefill_tokens_per_step}")
        if not route_attention(model):
            raise ValueError(f"{type(model).__module__} is not supported by the ragged batch")
        acceleration.prepare()
        self.model = model
        # The vocabulary projection runs on the rows that sample only: a step finishing a
        # 256-token prompt chunk would otherwise project all 256 (~14 GFLOP for SmolLM2's
        # 49K vocabulary, ~0.1 s here) to keep one.
        split = body_and_head(model)
        self._body: Any = None if split is None else split[0]
        self._head: Any = None if split is None else split[1]
        # Per layer, the sliding window of its attention (None: full), as the model's own caches say.
        self.windows = layer_windows(model)
        self.kinds = layer_kinds(model)
        self.latent = type(model).__module__ in LATENT_MODULES
        # State layers (SSM, linear attention): a row's state is checkpointed where its length is a
        # multiple of this (engine/batch/backends.py), so no run crosses one.
        self.has_state = any(k != "kv" for k in self.kinds)
        self.block_tokens = 256
        self.prefill_tokens_per_step = prefill_tokens_per_step
        self.rows: dict[int, Row] = {}
        self.prompt_tokens_run = 0  # prompt tokens fed, less each prompt's last (as mlx-lm counts)
        self.steps = 0
        self.last_step = StepStats()
        self.slots = ShortSlots()
        # The slots attend plainly (not MLA) and hold K/V only (no state).
        self.short_slots = short_slots and not self.latent and not self.has_state
        self._held_back_last_step = False
        self._next_uid = 0
        self.cost = StepCost()  # bounds the finishing rows a step carries (engine/batch/step_cost.py)
        self.speculation: Speculation | None = None  # drafting policy, where the engine turns it on
        # Per decode step shape, the CPU shortcuts' split or MLX's fused calls (engine/batch/split_choice.py).
        self.split_choice = SplitChoice()
        self._split_step: tuple[Key, bool] | None = None

    def insert(
        self,
        layers: list[Any],
        cached_tokens: list[int],
        prompt_rest: list[int],
        *,
        max_tokens: int,
        sampler: Sampler | None,
        stop_token_ids: frozenset[int],
        processors: list[LogitsProcessor] | None = None,
        top_logprobs: int | None = None,
    ) -> int:
        """Add a row whose `layers` hold `cached_tokens`; `prompt_rest` (at least one token) follows.

        `processors` touch this row's logits only; `top_logprobs` (not None) asks for each token's
        log probability and that many best tokens of its step."""
        if not prompt_rest:
            raise ValueError("a row needs at least one prompt token after its cache")
        uid = self._next_uid
        self._next_uid += 1
        self.rows[uid] = Row(
            uid=uid,
            layers=layers,
            cached_tokens=list(cached_tokens),
            pending=list(prompt_rest),
            max_tokens=max_tokens,
            sampler=sampler,
            stop_token_ids=stop_token_ids,
            inserted_step=self.steps,
            processors=list(processors or ()),
            top_logprobs=top_logprobs,
        )
        return uid

    def remove(self, uid: int) -> Row | None:
        """Take a row out; its own layers then hold all its K/V."""
        row = self.rows.pop(uid, None)
        if row is not None and row in self.slots:
            self.slots.leave(row)
        return row

    def has_work(self) -> bool:
        return bool(self.rows)

    def close(self) -> None:
        self.rows.clear()
        self.slots.clear()

    def step(self) -> list[RowToken]:
        """One forward pass: one token of every decoding row (and the draft the speculation policy
        gave it, if any: engine/batch/speculation.py) plus up to prefill_tokens_per_step prompt
        tokens (shortest remaining prompt first). A row whose prompt ends in this step samples its
        first token from it; a drafted row gets its accepted drafts and one more. Finished rows
        stay until `remove`."""
        self.steps += 1
        step_start = time.perf_counter()
        live = [row for row in self.rows.values() if not row.finished]
        chunks = self._prefill_chunks([row for row in live if not row.decoding])
        self._draft(live, chunks)
        self._assign_slots(live)
        slotted = list(self.slots.rows)  # first: their tokens lead the flat batch
        runs = [(row, 1) for row in slotted]
        runs += [(row, len(row.pending)) for row in live if row.decoding and row not in self.slots]
        runs += chunks
        stats = StepStats(decode_rows=sum(1 for row in live if row.decoding))
        if not runs:
            self.last_step = stats
            return []
        start = time.perf_counter()
        sampled, logprobs = self._forward(runs)
        stats.forward_s = time.perf_counter() - start
        if self._split_step is not None:
            self.split_choice.record(*self._split_step, stats.forward_s)
        out = []
        for row, n in runs:
            fed = row.pending[:n]
            del row.pending[:n]
            if row.sampled and n > 1:
                out += self._take_drafted(row, fed, sampled[row.uid], logprobs.get(row.uid), stats)
                continue
            row.cached_tokens.extend(fed)
            if not row.decoding:
                stats.prompt_tokens += n
                self.prompt_tokens_run += n - (0 if row.pending else 1)
            if row.pending:
                continue  # prompt not done: no token yet
            token = sampled[row.uid][0]
            row.pending = [token]
            reason = self._sampled(row, token)
            reported = logprobs.get(row.uid)
            out.append(RowToken(row.uid, token, reason, reported[0] if reported else None))
        self.last_step = stats
        stats.step_s = time.perf_counter() - step_start
        if self.speculation is not None:
            self.speculation.record_step(stats)
        if not stats.draft_tokens:  # draft tokens are no prompt tokens: StepCost learns plain steps only
            self.cost.record(stats)
        return out

    @staticmethod
    def _sampled(row: Row, token: int) -> str | None:
        """Take the row's next token: why it ends the row ("stop", "length"), or None."""
        row.sampled.append(token)
        if row.processors and ends_row(row.processors, token):
            row.ended = True
        if token in row.stop_token_ids or row.ended:
            return "stop"
        if len(row.sampled) >= row.max_tokens:
            return "length"
        return None

    def _draft(self, live: list[Row], chunks: list[tuple[Row, int]]) -> None:
        """Put this step's drafts after the last token of the rows the speculation policy picks."""
        if self.speculation is None:
            return
        decoding = [row for row in live if row.decoding]
        candidates = [(row, row.speculation) for row in decoding if row.speculation is not None]
        extra_s = sum(n for _, n in chunks) * (self.cost.per_token_s or 0.0)
        plan = self.speculation.plan(candidates, len(decoding), self.steps, extra_s, self.cost.token_price_s)
        for uid, draft in plan.items():
            row = self.rows[uid]
            if row.processors:  # a grammar row drafts what its grammar admits (can_draft)
                draft, masks = allowed_draft(row.processors, draft)
                row.draft_masks = masks if draft else None
            row.pending += draft

    def _take_drafted(
        self,
        row: Row,
        fed: list[int],
        tokens: list[int],
        logprobs: list[TokenLogprobs] | None,
        stats: StepStats,
    ) -> list[RowToken]:
        """A drafted row's verified tokens, up to the first that ends it; its caches keep the fed
        tokens before each kept one and drop the rest (a trim: the next step writes over them)."""
        assert row.speculation is not None
        drafted, accepted = len(fed) - 1, len(tokens) - 1
        row.speculation.record(drafted, accepted, self.steps)
        stats.draft_tokens += drafted
        stats.accepted_tokens += accepted
        row.draft_masks = None
        out = []
        for i, token in enumerate(tokens):
            reason = self._sampled(row, token)
            out.append(RowToken(row.uid, token, reason, logprobs[i] if logprobs else None))
            if reason is not None:
                break
        kept = len(out)
        row.cached_tokens.extend(fed[:kept])
        row.pending = [out[-1].token]
        for layer in row.layers:
            layer.trim(len(fed) - kept)
        return out

    def _prefill_chunks(self, prefilling: list[Row]) -> list[tuple[Row, int]]:
        """This step's prompt tokens: shortest remaining prompt first, within the budget.

        A step in which short prompts finish (up to half the budget: typically warm agents'
        suffixes) carries no chunk of a longer one that does not: they get their first token
        from a step as short as the decode steps, not one carrying a whole budget of someone's
        cold prompt. A step finishing a longer run (a cold prompt's last chunk) is long anyway:
        it fills the budget and holds nothing back, so that the warm suffix arriving next is
        not the one forced to share its step. So that long prompts are never starved, a chunk
        held back goes into the next step whatever finishes there.
        """
        budget = self.prefill_tokens_per_step
        chunks: list[tuple[Row, int]] = []
        held_back = False
        whole = [len(r.pending) for r in prefilling if len(r.pending) <= budget]
        join_tokens = self.cost.join_tokens(whole) or budget
        finished = 0  # prompt tokens of rows finishing in this step
        for row in sorted(prefilling, key=lambda r: (len(r.pending), r.inserted_step, r.uid)):
            if budget <= 0:
                break
            n = min(budget, len(row.pending))
            if self.has_state:  # end on the next block boundary: the state is checkpointed there
                n = min(n, (row.length // self.block_tokens + 1) * self.block_tokens - row.length)
            if n == len(row.pending) and chunks and finished + n > join_tokens:
                break  # a burst of joiners: the rest finish in the next steps (StepCost)
            finished += n if n == len(row.pending) else 0
            finishing_tokens = self.prefill_tokens_per_step - budget
            if (
                n < len(row.pending)
                and chunks
                and finishing_tokens * 2 <= self.prefill_tokens_per_step
                and not self._held_back_last_step
            ):
                held_back = True
                break
            chunks.append((row, n))
            budget -= n
        self._held_back_last_step = held_back
        return chunks

    def _assign_slots(self, live: list[Row]) -> None:
        """Finished rows, drafting rows and rows about to outgrow SHORT_ROW_TOKENS leave the slots;
        short decoding rows enter them (a drafted row's way out is timed with its step: Speculation
        learns what it costs)."""
        for row in list(self.slots.rows):
            if row.finished or row.drafting or row.length + 1 > SHORT_ROW_TOKENS:
                self.slots.leave(row)
        for row in live if self.short_slots else ():
            if (
                row.decoding
                and not row.drafting
                and row.length + 1 <= SHORT_ROW_TOKENS
                and row not in self.slots
                and holds_all(row)
            ):
                self.slots.enter(row)

    def _forward(
        self, runs: list[tuple[Row, int]]
    ) -> tuple[dict[int, list[int]], dict[int, list[TokenLogprobs]]]:
        """Run the flat batch; sample a token for every row whose pending tokens all ran (and the
        log probabilities of the rows that asked for them); a drafted row's tokens are its verified
        drafts and the one after them."""
        tokens: list[int] = []
        positions: list[int] = []
        for row, n in runs:
            tokens.extend(row.pending[:n])
            positions.extend(range(row.length, row.length + n))
        scores = sum(n * (row.length + n) for row, n in runs)
        shortcuts = acceleration.step_shortcuts(len(tokens), scores)
        self._split_step = None
        if all(n == 1 and row.decoding for row, n in runs):  # a plain decode step: SplitChoice's
            key = (len(tokens), scores.bit_length())
            shortcuts, split = self.split_choice.pick(key, shortcuts, acceleration.fused(shortcuts))
            self._split_step = None if split is None else (key, split)
        padding = acceleration.padded_rows(len(tokens), shortcuts) - len(tokens)
        tokens += [0] * padding
        positions += [0] * padding
        n_layers = len(runs[0][0].layers)
        slot_step = self.slots.prepare_step()
        own = runs[slot_step.size :] if slot_step is not None else runs
        lengths = [n for _, n in own]
        position_array = mx.array(positions)
        slot_masks = slot_window_masks(slot_step, self.windows)

        def flat(kind: Any, layers: list[Any], i: int) -> Any:
            if isinstance(kind, list):  # a CacheList: its members' views
                return FlatCacheList(
                    [flat(k, [layer.caches[m] for layer in layers], i) for m, k in enumerate(kind)]
                )
            if kind == "state":
                return FlatStateCache(layers, lengths, padding)
            window = self.windows[i]
            return FlatLayerCache(
                layers,
                lengths,
                position_array,
                self.slots,
                slot_step,
                i,
                padding,
                slot_masks.get(window),
                self.latent,
            )

        caches = [flat(self.kinds[i], [row.layers[i] for row, _ in own], i) for i in range(n_layers)]
        with acceleration.in_step(shortcuts):
            if self._body is None:  # the whole model (WHOLE_MODEL): logits for every token
                hidden = self.model(mx.array(tokens)[:, None], caches)[:, -1, :]
            else:
                hidden = self._body(mx.array(tokens)[:, None], caches)[:, -1, :]
        ends, last = [], -1
        for _, n in runs:
            last += n
            ends.append(last)
        finishing = [(row, end) for (row, n), end in zip(runs, ends, strict=True) if n == len(row.pending)]
        written = [
            self.slots.keys,
            self.slots.values,
            [layer_arrays(layer) for row, _ in own for layer in row.layers],
        ]
        if not finishing:
            mx.eval(written)
            return {}, {}
        # Padded like the step's rows (engine/cpu/gemm_rows.py): the head's matmul is the step's largest.
        # A drafted row's every position is projected: each verifies the draft token after it.
        picks = [
            p
            for row, end in finishing
            for p in range(end + 1 - (len(row.pending) if row.drafting else 1), end + 1)
        ]
        n_picks = len(picks)
        picks += picks[-1:] * (acceleration.padded_rows(n_picks, shortcuts) - n_picks)
        picked = hidden[mx.array(picks)]
        picked = (picked if self._head is None else self._head(picked))[:n_picks]
        rows = [row for row, _ in finishing]
        if all(row.plain for row in rows):
            # Greedy: the log-softmax shifts a row by one constant, so argmax needs no exp
            # (49K of them a row: 12 ms of a 16-row step on this CPU).
            choice = mx.argmax(picked, axis=-1)
            mx.eval(choice, written)
            values: list[int] = choice.tolist()  # type: ignore[assignment]
            return dict(verified(rows, values)), {}
        return self._sample_rows(rows, picked, written)

    def _sample_rows(
        self, rows: list[Row], picked: mx.array, written: list[Any]
    ) -> tuple[dict[int, list[int]], dict[int, list[TokenLogprobs]]]:
        """Each row on its own: its processors on its (1, vocab) logits (given the row's tokens so far,
        as mlx-lm gives them), then its sampler or argmax; logprobs after the processors, as mlx-lm's.
        A drafted row verifies its draft over its (k + 1, vocab) logits (a grammar row's masked by its
        draft_masks, each position in the grammar's state after the drafts before it): greedy against
        their argmax, sampled by speculative sampling (engine/batch/speculation.py)."""
        sizes = [len(row.pending) if row.drafting else 1 for row in rows]
        bounds = [sum(sizes[: i + 1]) for i in range(len(sizes) - 1)]
        parts = mx.split(picked, bounds, axis=0) if bounds else [picked]
        choices, all_logprobs = [], []
        for row, logits in zip(rows, parts, strict=True):
            if row.draft_masks is not None:  # a drafted grammar row: the masks of its draft's positions
                logits = mx.where(mx.array(row.draft_masks), logits, mx.array(-float("inf"), logits.dtype))
            elif row.processors:
                context = mx.array(row.cached_tokens + row.pending)
                for processor in row.processors:
                    logits = processor(context, logits)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            sampled_draft = row.drafting and row.sampler is not None
            if row.sampler is None or sampled_draft:  # a sampled draft draws in verify, below
                choices.append(mx.argmax(logprobs, axis=-1))
            else:
                choices.append(row.sampler(logprobs))
            all_logprobs.append(logprobs)
        choice = mx.concatenate(choices)
        mx.eval(choice, written)
        values: list[int] = choice.tolist()  # type: ignore[assignment]
        tokens = dict(verified(rows, values))
        for row, logprobs in zip(rows, all_logprobs, strict=True):
            if row.drafting and row.sampler is not None:
                assert row.speculation is not None and row.speculation.sampled is not None
                tokens[row.uid] = row.speculation.sampled.verify(logprobs, row.pending[1:])
        reported = {}
        for row, logprobs in zip(rows, all_logprobs, strict=True):
            if row.top_logprobs is not None:
                chosen = tokens[row.uid]
                reported[row.uid] = token_logprobs(logprobs[: len(chosen)], chosen, row.top_logprobs)
        return tokens, reported
