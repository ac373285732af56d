"""The two generation loops the engine can drive, behind one small interface.

- RaggedBackend (engine/batch/ragged.py): per-row KV buffers, chunked prefill between decode
  steps; used for every architecture it is verified on (ragged.SUPPORTED_MODULES) whose layers
  are all full or sliding-window attention, each of its own shape (`ragged_fits`).
- MlxBatchBackend: mlx-lm's own BatchGenerator, the fallback for the rest (MLA, SSM state,
  architectures not verified); models with SSM state use its subclass
  engine/batch/checkpoints.py, which checkpoints the state at block boundaries.

Both take a prompt (with an optional saved cache prefix) and give back per-step tokens
and, for a finished sequence, its per-layer KV and the tokens that KV covers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from mlx_lm.generate import BatchGenerator, StopSequences

from engine.batch.ragged import RaggedBatchGenerator, route_attention
from engine.batch.sampling import Sampler, ends_row, token_logprobs
from engine.core.blocks import AgentCache
from engine.core.params import LogitsProcessor
from engine.core.results import TokenLogprobs
from engine.core.spec import ModelCacheSpec
from engine.kv.arena import KVArena
from engine.kv.buffers import round_up
from engine.kv.convert import blocks_to_caches
from engine.kv.layered import KEEP_CHECKPOINTS, Checkpoint, inherited_checkpoints, take_checkpoint
from engine.kv.quant import KVQuant
from engine.kv.quantized import blocks_to_quantized_caches, empty_quantized_caches
from engine.kv.window import WindowKVCache


def ragged_fits(spec: ModelCacheSpec, model: Any) -> bool:
    """Whether the ragged batch runs this model: a verified architecture (its attention and state
    mixers routed). Every layer kind the spec knows runs there (full, sliding, state, CacheList)."""
    return route_attention(model)


def row_cache(cache: Any) -> Any:
    """A layer cache as a ragged row holds it: a RotatingKVCache becomes a WindowKVCache (engine/kv/
    window.py), a CacheList's members likewise; anything else as it is."""
    from mlx_lm.models.cache import CacheList, RotatingKVCache

    if isinstance(cache, RotatingKVCache):
        return WindowKVCache.from_rotating(cache)
    if isinstance(cache, CacheList):
        return CacheList(*(row_cache(member) for member in cache.caches))
    return cache


def one_head_count(spec: ModelCacheSpec) -> bool:
    """Every KV layer has the model-wide head count: what the ShortSlots' shared buffers need."""
    return all(layer.n_kv_heads == spec.n_kv_heads for layer in spec.kv_layers())


@dataclass(frozen=True)
class GeneratedToken:
    uid: int
    token: int
    finish_reason: str | None  # "stop" (a stop token), "length", or None while running
    logprobs: TokenLogprobs | None = None  # for sequences that asked for them


@dataclass(frozen=True)
class FinishedKV:
    layers: list[Any]  # one mlx-lm KVCache (or compatible) per layer
    tokens: list[int]  # the tokens whose K/V `layers` hold
    checkpoints: dict[int, Any] = field(default_factory=dict)  # SSM state by block end: checkpoints.py


class Backend(Protocol):
    def insert(
        self,
        prompt: list[int],
        cache: AgentCache | None,
        reused: int,
        *,
        max_tokens: int,
        sampler: Sampler | None,
        stop_token_ids: frozenset[int],
        processors: list[LogitsProcessor] | None = None,
        top_logprobs: int | None = None,
    ) -> int:
        """`processors` (mlx-lm's signature) touch this sequence's logits only; `top_logprobs` (not
        None) asks for each token's log probability and that many best tokens of its step."""
        ...

    def reserve(self, n_prompt_tokens: int, max_tokens: int) -> bool:
        """Start making a sequence's KV buffers ahead, off the step thread: True if started."""
        ...

    def stock(self, n_tokens: Sequence[int]) -> int:
        """Make idle KV buffers for sequences of these lengths now (waits): how many were made."""
        ...

    def step(self) -> list[GeneratedToken]: ...

    def finish(self, uid: int, want_kv: bool) -> FinishedKV | None:
        """Take a sequence out (finished or not); its KV when asked for and available."""
        ...

    def release(self, kv: FinishedKV) -> None:
        """The caller is done with `kv` (its blocks are cut): memory may be reused."""
        ...

    def prompt_tokens_processed(self) -> int: ...

    def close(self) -> None: ...


class RaggedBackend:
    def __init__(
        self,
        model: Any,
        spec: ModelCacheSpec,
        arena: KVArena,
        *,
        prefill_tokens_per_step: int,
        kv_quant: KVQuant | None = None,
    ) -> None:
        """`kv_quant`: rows keep their K/V quantized (engine/kv/quantized.py); the arena and the
        ShortSlots, which hold full-precision buffers, are then not used."""
        self.generator = RaggedBatchGenerator(
            model,
            prefill_tokens_per_step=prefill_tokens_per_step,
            short_slots=kv_quant is None and one_head_count(spec),
        )
        if kv_quant is not None and self.generator.latent:
            raise ValueError(
                f"kv_bits is not supported for {type(model).__module__}: its MLA attention over the "
                "latent cache runs unquantized: leave kv_bits unset"
            )
        self.spec = spec
        self.arena = arena
        self.kv_quant = kv_quant
        self._checkpoints: dict[int, dict[int, Checkpoint]] = {}  # uid -> SSM state by block end

    def insert(
        self,
        prompt: list[int],
        cache: AgentCache | None,
        reused: int,
        *,
        max_tokens: int,
        sampler: Sampler | None,
        stop_token_ids: frozenset[int],
        processors: list[LogitsProcessor] | None = None,
        top_logprobs: int | None = None,
    ) -> int:
        capacity = self._capacity(len(prompt), max_tokens)
        if self.kv_quant is not None:
            if cache is not None and reused > 0:
                layers = blocks_to_quantized_caches(cache, reused, self.kv_quant, capacity)
            else:
                layers = empty_quantized_caches(self.spec, self.kv_quant, capacity)
        elif not self.spec.all_full_attention:  # sliding layers or per-layer shapes: not the arena's
            layers = self._layered_layers(cache, reused)
        elif cache is not None and reused > 0:
            layers = blocks_to_caches(cache, reused, capacity=capacity, arena=self.arena)
        else:
            layers = self._empty_layers(capacity)
        uid = self.generator.insert(
            layers,
            prompt[:reused],
            prompt[reused:],
            max_tokens=max_tokens,
            sampler=sampler,
            stop_token_ids=stop_token_ids,
            processors=processors,
            top_logprobs=top_logprobs,
        )
        if self.spec.has_state_layers:  # a resumed row keeps the checkpoints it stands on
            self._checkpoints[uid] = inherited_checkpoints(cache, reused) if cache is not None else {}
        return uid

    @property
    def _arena_serves(self) -> bool:
        """Whether rows keep their K/V in the arena's buffers: plain K/V of one shape in every layer
        (quantized, windowed or per-layer buffers are made at insert and left to MLX's allocator)."""
        return self.kv_quant is None and self.spec.all_full_attention

    def _capacity(self, n_prompt_tokens: int, max_tokens: int) -> int:
        """Room for the prompt and a block of output; longer outputs grow 256 tokens at a time."""
        return n_prompt_tokens + min(max_tokens, self.spec.block_tokens)

    def reserve(self, n_prompt_tokens: int, max_tokens: int) -> bool:
        """The arena's buffers for this sequence, made ahead (engine/kv/arena.py); rows the arena
        does not serve (quantized, sliding, per-layer shapes, SSM state) make their own at insert."""
        if not self._arena_serves:
            return False
        return self.arena.reserve(self._capacity(n_prompt_tokens, max_tokens))

    def stock(self, n_tokens: Sequence[int]) -> int:
        if not self._arena_serves:
            return 0
        made = sum(self.arena.stock(n) for n in n_tokens)
        self.arena.wait_made()
        return made

    def _empty_layers(self, capacity: int) -> list[Any]:
        from mlx_lm.models.cache import KVCache

        layers = []
        for keys, values in self.arena.take(capacity):
            layer = KVCache()
            layer.keys, layer.values = keys, values
            layers.append(layer)
        return layers

    def _layered_layers(self, cache: AgentCache | None, reused: int) -> list[Any]:
        """A row's caches for a model that is not plain full attention: the model's own cache list
        (KVCache, ArraysCache for SSM state, CacheList), sliding layers as WindowKVCaches; from the
        saved blocks when resumed (a sliding layer's blocks hold its window's tokens, in order; a
        state layer's the checkpoint at the resume point)."""
        from mlx_lm.models.cache import make_prompt_cache

        if cache is not None and reused > 0:
            return [row_cache(c) for c in blocks_to_caches(cache, reused)]  # engine/kv/layered.py
        return [row_cache(c) for c in make_prompt_cache(self.generator.model)]

    def _checkpoint(self) -> None:
        """Copy the state of every row that stands on a block boundary (the ragged step ends a
        state model's runs there) to the host: what its blocks keep for a later resume."""
        block = self.spec.block_tokens
        for uid, row in self.generator.rows.items():
            length = row.length
            if length == 0 or length % block:
                continue
            taken = self._checkpoints.setdefault(uid, {})
            if length not in taken:
                taken[length] = take_checkpoint(row.layers, self.spec)
                for old in sorted(taken)[:-KEEP_CHECKPOINTS]:
                    del taken[old]

    def step(self) -> list[GeneratedToken]:
        out = [GeneratedToken(t.uid, t.token, t.finish_reason, t.logprobs) for t in self.generator.step()]
        if self.spec.has_state_layers:
            self._checkpoint()
        return out

    def finish(self, uid: int, want_kv: bool) -> FinishedKV | None:
        row = self.generator.remove(uid)
        checkpoints = self._checkpoints.pop(uid, {})
        if row is None:
            return None
        kv = FinishedKV(row.layers, row.cached_tokens, checkpoints)
        if want_kv:
            return kv
        self.release(kv)
        return None

    def release(self, kv: FinishedKV) -> None:
        if not self._arena_serves:
            return
        buffers = [(layer.keys, layer.values) for layer in kv.layers]
        if all(
            k is not None and k.shape[2] == round_up(k.shape[2], self.spec.block_tokens) for k, _ in buffers
        ):
            self.arena.give_back(buffers)

    def prompt_tokens_processed(self) -> int:
        return self.generator.prompt_tokens_run

    def close(self) -> None:
        self.generator.close()
        self.arena.close()


class MlxBatchBackend:
    def __init__(self, model: Any, *, max_batch: int, prefill_step_size: int) -> None:
        self.generator = BatchGenerator(
            model,
            completion_batch_size=max_batch,
            prefill_batch_size=min(8, max_batch),
            prefill_step_size=prefill_step_size,
        )
        self._finished: dict[int, FinishedKV | None] = {}  # ended by the generator itself
        self._top_logprobs: dict[int, int] = {}  # uid -> top count, for sequences that asked for logprobs
        self._processors: dict[int, list[LogitsProcessor]] = {}  # uid -> processors that may end a row

    def insert(
        self,
        prompt: list[int],
        cache: AgentCache | None,
        reused: int,
        *,
        max_tokens: int,
        sampler: Sampler | None,
        stop_token_ids: frozenset[int],
        processors: list[LogitsProcessor] | None = None,
        top_logprobs: int | None = None,
    ) -> int:
        layer_caches = [blocks_to_caches(cache, reused)] if cache is not None and reused > 0 else None
        (uid,) = self.generator.insert(
            [prompt[reused:]],
            max_tokens=[max_tokens],
            caches=layer_caches,
            all_tokens=[prompt[:reused]],
            samplers=[sampler],  # type: ignore[list-item]
            logits_processors=[list(processors or ())],
            stop_sequences=[StopSequences([[t] for t in sorted(stop_token_ids)])],
        )
        self._follow(int(uid), processors, top_logprobs)
        return int(uid)

    def _follow(self, uid: int, processors: list[LogitsProcessor] | None, top_logprobs: int | None) -> None:
        """Remember what step() must do for this sequence beyond mlx-lm's own."""
        if top_logprobs is not None:
            self._top_logprobs[uid] = top_logprobs
        if any(hasattr(p, "ends_row") for p in processors or ()):
            self._processors[uid] = list(processors or ())

    def step(self) -> list[GeneratedToken]:
        _, responses = self.generator.next()
        return [self._generated(response) for response in responses]

    def _generated(self, response: Any) -> GeneratedToken:
        """One response of the generator as a token: its ending (the generator's, or a processor's
        that ends the row) and its logprobs when the sequence asked for them."""
        uid, token = int(response.uid), int(response.token)
        reason = None if response.finish_reason is None else str(response.finish_reason)
        processors = self._processors.get(uid)
        if reason is None and processors and ends_row(processors, token):
            reason = "stop"
            self._finished[uid] = self._extract(uid)
        elif reason is not None:
            cache = response.prompt_cache
            self._finished[uid] = None if cache is None else FinishedKV(cache, list(response.all_tokens))
        logprobs = None
        if (top := self._top_logprobs.get(uid)) is not None:
            (logprobs,) = token_logprobs(response.logprobs[None], [token], top)
        return GeneratedToken(uid, token, reason, logprobs)

    def _extract(self, uid: int) -> FinishedKV:
        extracted = self.generator.remove([uid], return_prompt_caches=True)
        layers, tokens = extracted[uid]
        return FinishedKV(layers, list(tokens))

    def finish(self, uid: int, want_kv: bool) -> FinishedKV | None:
        self._top_logprobs.pop(uid, None)
        self._processors.pop(uid, None)
        if uid in self._finished:
            done = self._finished.pop(uid)
            return done if want_kv else None
        if not want_kv:
            self.generator.remove([uid])
            return None
        return self._extract(uid)

    def release(self, kv: FinishedKV) -> None:
        pass  # the batch cache is BatchGenerator's own

    def reserve(self, n_prompt_tokens: int, max_tokens: int) -> bool:
        return False  # BatchGenerator makes its own batch cache

    def stock(self, n_tokens: Sequence[int]) -> int:
        return 0

    def prompt_tokens_processed(self) -> int:
        return int(self.generator._counters.prompt_tokens)

    def close(self) -> None:
        self.generator.close()
