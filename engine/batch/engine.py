"""BlockPoolBatchEngine: continuous batching with every sequence's KV accounted for in a
pool of 256-token blocks and handed out as blocks when it ends.

A backend does the batching (engine/batch/backends.py): the ragged batch (engine/batch/ragged.py:
per-row KV, chunked prefill between decode steps, warm agents join without padding
anyone) for the architectures it is verified on, mlx-lm's BatchGenerator for the rest.
This class adds validation, block budgets, prefix reuse from an agent's saved cache,
stop strings, incremental text, and the cut of each finished sequence's KV into blocks
(on a background thread, so a burst of endings never stalls the batch: a completion can
come a few steps after its last token, and has_work() stays true until it has).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from engine.batch.acceleration import log, step_rows
from engine.batch.backends import Backend, FinishedKV, MlxBatchBackend, RaggedBackend, ragged_fits
from engine.batch.checkpoints import CheckpointingBatchBackend
from engine.batch.drafters import Drafter, DraftModel, PromptLookup
from engine.batch.grammar import GrammarCompiler
from engine.batch.sampling import make_processors, make_sampler
from engine.batch.speculation import RowSpeculation, SampledDraws, Speculation, SpeculationStats, can_draft
from engine.batch.textstream import TextStream
from engine.core.admission import Admission
from engine.core.blocks import AgentCache, BlockPool, common_prefix_length
from engine.core.errors import InvalidRequestError
from engine.core.params import SamplingParams
from engine.core.results import Completion, FinishReason, StepOutput, TokenDelta, TokenLogprobs, Usage
from engine.core.spec import ModelCacheSpec
from engine.core.switches import switch
from engine.kv.arena import KVArena
from engine.kv.buffers import keep_buffers_resident, yield_to_the_step
from engine.kv.convert import caches_to_blocks, copy_into_blocks, host_layers
from engine.kv.host_slab import BlockSlab
from engine.kv.quant import kv_quant
from engine.kv.quantized import (
    convert_cache,
    copy_quantized_into_blocks,
    quantized_bytes_per_block,
    quantized_host_layers,
)
from engine.models.cache_layout import spec_from_model

DEFAULT_POOL_MB = 2048
DEFAULT_CONTEXT = 8192
#: KVRQ_SPECULATION's default: on. The policy drafts only where the learnt step cost says it pays
#: (engine/batch/speculation.py); KVRQ_SPECULATION=0 turns it off.
SPECULATION_DEFAULT = True


@dataclass
class _Sequence:
    uid: int
    agent_id: str | None
    prompt_tokens: list[int]
    reused_tokens: int
    stop_token_ids: frozenset[int]
    keep_cache: bool
    text: TextStream
    submitted_at: float
    generated: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    logprobs: list[TokenLogprobs] | None = None  # None: not asked for


@dataclass
class _Cut:
    """A finished sequence whose KV a background thread is copying into blocks."""

    seq: _Sequence
    reason: FinishReason
    kv: FinishedKV
    blocks: Future[AgentCache]


class BlockPoolBatchEngine:
    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        model_name: str,
        spec: ModelCacheSpec | None = None,
        pool_blocks: int | None = None,
        pool_mb: float | None = None,
        max_batch: int = 16,
        prefill_step_size: int = 512,
        max_context: int | None = None,
        prefill_tokens_per_step: int = 256,
        ragged: bool | None = None,
        kv_bits: int | None = None,
        kv_group_size: int | None = None,
        speculation: bool | None = None,
        draft_model: Any = None,
        draft_model_name: str | None = None,
    ) -> None:
        """`prefill_tokens_per_step` bounds the prompt tokens run between two decode steps
        (the ragged batch); `ragged=None` uses the ragged batch wherever it is supported,
        False forces mlx-lm's BatchGenerator (`prefill_step_size` is its chunk).

        `kv_bits` (8 or 4; `kv_group_size` 32, 64 or 128, default 64) keeps running K/V and
        finished blocks quantized (engine/kv/quantized.py), and the pool's budget counts
        quantized bytes; the ragged batch only (ValueError elsewhere).

        `speculation` (None: the KVRQ_SPECULATION switch, SPECULATION_DEFAULT unless set) lets decoding rows
        verify prompt-lookup drafts where it pays (engine/batch/speculation.py); ragged batch only.
        `draft_model`, a small model of the same vocabulary, drafts instead of the prompt lookup
        (engine/batch/drafters.py; it turns speculation on unless `speculation` is False);
        `draft_model_name`, what the operator asked for, names it in the log."""
        if max_batch <= 0:
            raise ValueError(f"max_batch must be positive, got {max_batch}")
        self.model = model
        self.tokenizer = tokenizer
        self.spec = spec or spec_from_model(model, model_name)
        self.kv_quant = kv_quant(kv_bits, kv_group_size, (self.spec.k_head_dim, self.spec.v_head_dim))
        block_bytes = self.spec.bytes_per_block()
        if self.kv_quant is not None:
            block_bytes = quantized_bytes_per_block(self.spec, self.kv_quant)
        if pool_blocks is not None:
            self.pool = BlockPool(pool_blocks)
        else:
            self.pool = BlockPool.from_megabytes(pool_mb or DEFAULT_POOL_MB, self.spec, block_bytes)
        self.block_bytes = block_bytes
        self.max_batch = max_batch
        pool_bytes = self.pool.total_blocks * block_bytes
        # Memory kept for reuse instead of freed (fresh pages cost more than the copies into
        # them, engine/kv/convert.py), bounded all together by the pool's own size: half for
        # the arena's idle KV buffers, a quarter each for MLX's allocator cache and the slab's
        # idle host slots. A worker then stays within model + 2 x pool + hot tier + pending
        # writes (docs/worker.md, "Memory").
        keep_buffers_resident(pool_bytes // 4)
        self._slab = BlockSlab(self.spec.bytes_per_block(), max_idle_slots=self.pool.total_blocks // 4)
        args = getattr(model, "args", None)
        self.max_context = max_context or getattr(args, "max_position_embeddings", None) or DEFAULT_CONTEXT
        self.vocab_size = int(getattr(args, "vocab_size", 0) or 0)
        self.eos_token_ids = frozenset(int(t) for t in getattr(tokenizer, "eos_token_ids", ()) or ())
        self.grammars = GrammarCompiler(tokenizer, self.vocab_size, self.eos_token_ids)
        use_ragged = ragged_fits(self.spec, model) if ragged is not False else False
        if ragged and not use_ragged:
            raise ValueError(f"{type(model).__module__} cannot run in the ragged batch")
        if self.kv_quant is not None and use_ragged and not self.spec.all_full_attention:
            raise ValueError(
                f"kv_bits needs every layer to be full attention of one shape; {type(model).__module__} "
                "has sliding-window layers, per-layer shapes or SSM state, whose caches the ragged "
                "batch keeps unquantized: leave kv_bits unset"
            )
        if self.kv_quant is not None and not use_ragged:
            raise ValueError(
                f"kv_bits needs the ragged batch, which {type(model).__module__} does not run on "
                "(mlx-lm's BatchGenerator cannot batch quantized caches): leave kv_bits unset"
            )
        self._backend: Backend
        if use_ragged:
            arena = KVArena(self.spec, max_idle_bytes=pool_bytes // 2)
            self._backend = RaggedBackend(
                model,
                self.spec,
                arena,
                prefill_tokens_per_step=prefill_tokens_per_step,
                kv_quant=self.kv_quant,
            )
        elif (
            self.spec.has_state_layers
        ):  # SSM state is checkpointed at block ends (engine/batch/checkpoints.py)
            self._backend = CheckpointingBatchBackend(
                model, self.spec, max_batch=max_batch, prefill_step_size=prefill_step_size
            )
        else:
            self._backend = MlxBatchBackend(model, max_batch=max_batch, prefill_step_size=prefill_step_size)
        self.ragged = use_ragged
        self.drafter: Drafter = PromptLookup(tokenizer)
        if draft_model is not None:
            self.drafter = DraftModel(draft_model, self.vocab_size)
            log.info(  # what an operator needs to see whether it can ever pay (docs/worker.md)
                "draft model %s: %.2f ms a guessed token, %.3f ms a context token read",
                draft_model_name or type(draft_model).__module__,
                self.drafter.token_s * 1000,
                self.drafter.prompt_token_s * 1000,
            )
        if speculation is None:
            speculation = draft_model is not None or switch("KVRQ_SPECULATION", default=SPECULATION_DEFAULT)
        self.speculation: Speculation | None = None
        if speculation and isinstance(self._backend, RaggedBackend):
            self.speculation = self._backend.generator.speculation = Speculation(
                step_rows=step_rows, drafter=self.drafter
            )
        elif draft_model is not None and speculation:
            raise ValueError(
                f"a draft model needs the ragged batch, which {type(model).__module__} does not run on: "
                "leave draft_model unset"
            )
        self._sequences: dict[int, _Sequence] = {}
        # Cutting a finished sequence's KV into blocks is a copy of all of it: done on this
        # thread it stalled the whole batch for the step a burst of sequences ended in.
        self._cutter = ThreadPoolExecutor(1, thread_name_prefix="kvrq-cut", initializer=yield_to_the_step)
        self._cuts: list[_Cut] = []

    # ---- admission -------------------------------------------------------------------

    def blocks_needed(self, n_prompt_tokens: int, max_tokens: int) -> int:
        return self.spec.blocks_for(n_prompt_tokens + max_tokens)

    def free_slots(self) -> int:
        return max(0, self.max_batch - len(self._sequences))

    def admission(self, n_prompt_tokens: int, max_tokens: int) -> Admission:
        """Whether a request of this size can start now, later (once running ones end), or never.

        The one place the engine's budgets (batch slots, KV blocks, context) are judged;
        `submit` raises exactly when this does not say "now".
        """
        beyond_context = self._beyond_context(n_prompt_tokens, max_tokens)
        if beyond_context:
            return Admission("never", beyond_context)
        needed = self.blocks_needed(n_prompt_tokens, max_tokens)
        if needed > self.pool.total_blocks:
            return Admission(
                "never", f"needs {needed} blocks but the whole pool holds {self.pool.total_blocks}"
            )
        if self.free_slots() <= 0:
            return Admission("later", f"all {self.max_batch} batch slots are busy")
        if not self.pool.can_allocate(needed):
            free, total = self.pool.free_blocks, self.pool.total_blocks
            return Admission("later", f"KV blocks: needs {needed}, {free} of {total} free")
        return Admission("now")

    def reserve(self, n_prompt_tokens: int, max_tokens: int) -> bool:
        """Start making the KV buffers of a sequence this size on a background thread, so that its
        submit() does not pay for new memory on the step thread: call it as soon as a request's
        size is known (a worker: when it takes the job). True if started; False where buffers
        that fit are idle or already being made, or this batch makes its own. Never required."""
        if self._beyond_context(n_prompt_tokens, max_tokens):
            return False
        return self._backend.reserve(n_prompt_tokens, max_tokens)

    def keep_ready(self, n_tokens: Sequence[int]) -> int:
        """Make idle KV buffers now for sequences of these lengths (waits; within the arena's idle
        budget, which keeps a warm worker's buffers too): how many sets were made. A worker starting
        on a warm store calls it with its returning agents' lengths, so that they resume into
        buffers as a warm worker's agents do, not into new memory on the step thread."""
        return self._backend.stock([n for n in n_tokens if n > 0 and not self._beyond_context(n, 1)])

    def _beyond_context(self, n_prompt_tokens: int, max_tokens: int) -> str:
        if n_prompt_tokens + max_tokens <= self.max_context:
            return ""
        return (
            f"prompt ({n_prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the model "
            f"context of {self.max_context} tokens"
        )

    def active(self) -> int:
        return len(self._sequences)

    def has_work(self) -> bool:
        """Sequences running, or finished ones whose completion (cache being cut) is still to come."""
        return bool(self._sequences) or bool(self._cuts)

    def submit(
        self,
        agent_id: str | None,
        prompt_tokens: Sequence[int],
        params: SamplingParams,
        *,
        cache: AgentCache | None = None,
        keep_cache: bool = True,
    ) -> int:
        """Queue one sequence; it joins the batch at the next step.

        `keep_cache=False` skips cutting the finished KV into blocks (a one-off job
        with no agent has nowhere to save it): the completion's cache is then None.

        Raises InvalidRequestError (or RequestTooLargeError) for a request that can
        never run, PoolExhaustedError when the pool cannot hold it now (`admission`
        says which beforehand); in every case nothing has changed.
        """
        prompt = self._validate(prompt_tokens, params, cache)
        if cache is not None:
            cache = self.pool_precision(cache)
        owner = object()
        self.pool.allocate(owner, self.blocks_needed(len(prompt), params.max_tokens))
        try:
            reused = 0
            if cache is not None:
                reused = min(common_prefix_length(cache.token_ids, prompt), len(prompt) - 1)
                reused = cache.resume_point(reused)  # sliding windows and SSM checkpoints limit it
            stop_ids = self.eos_token_ids | frozenset(int(t) for t in params.stop_tokens)
            processors = make_processors(params)
            if params.grammar is not None:
                processors.append(self.grammars.processor(params.grammar))
            uid = self._backend.insert(
                prompt,
                cache,
                reused,
                max_tokens=params.max_tokens,
                sampler=make_sampler(params),
                stop_token_ids=stop_ids,
                processors=processors,
                top_logprobs=params.top_logprobs if params.logprobs else None,
            )
        except BaseException:
            self.pool.free(owner)
            raise
        self.pool.rename(owner, uid)
        if self.speculation is not None:
            self._may_draft(uid, params)
        self._sequences[uid] = _Sequence(
            uid=uid,
            agent_id=agent_id,
            prompt_tokens=prompt,
            reused_tokens=reused,
            stop_token_ids=stop_ids,
            keep_cache=keep_cache,
            text=TextStream(self.tokenizer, tuple(params.stop)),
            submitted_at=time.perf_counter(),
            logprobs=[] if params.logprobs else None,
        )
        return uid

    def speculation_stats(self) -> SpeculationStats | None:
        """Drafted steps, draft tokens verified and accepted so far; None with speculation off."""
        return None if self.speculation is None else self.speculation.stats

    def _may_draft(self, uid: int, params: SamplingParams) -> None:
        """Give a ragged row its drafting state where it can draft (engine/batch/speculation.py)."""
        assert isinstance(self._backend, RaggedBackend)
        row = self._backend.generator.rows[uid]
        # A seeded sampled row runs plainly: its seed promises the same tokens on every run (a re-run
        # after a crash, mlx-lm's own generate), and whether a step drafts depends on its timing.
        seeded = bool(params.temperature) and params.seed is not None
        if can_draft(row) and not seeded:
            row.speculation = RowSpeculation(
                sampled=SampledDraws(params) if params.temperature else None, drafter=self.drafter.for_row()
            )

    def check(self, params: SamplingParams) -> None:
        """InvalidRequestError for what this model can never honour: a value outside its vocabulary,
        a grammar that cannot be compiled for its tokenizer. Cheap enough to run when a job is taken."""
        params.validate(self.vocab_size)
        if params.grammar is not None:
            self.grammars.check(params.grammar)

    def _validate(
        self, prompt_tokens: Sequence[int], params: SamplingParams, cache: AgentCache | None
    ) -> list[int]:
        prompt = list(prompt_tokens)
        if not prompt:
            raise InvalidRequestError("prompt is empty: at least one token is needed")
        if any(isinstance(t, bool) or not isinstance(t, int) for t in prompt):
            raise InvalidRequestError("prompt tokens must be integers")
        if self.vocab_size and any(not 0 <= t < self.vocab_size for t in prompt):
            raise InvalidRequestError(f"prompt has token ids outside the vocabulary [0, {self.vocab_size})")
        self.check(params)
        beyond_context = self._beyond_context(len(prompt), params.max_tokens)
        if beyond_context:
            raise InvalidRequestError(beyond_context)
        if cache is not None:
            cache.validate(self.spec)
        return prompt

    def pool_precision(self, cache: AgentCache) -> AgentCache:
        """`cache` as this pool holds K/V: converted once (quantized or dequantized) if it was
        saved at another precision, itself otherwise. submit() calls it; a caller may do it
        earlier, off the step's thread."""
        return convert_cache(cache, self.kv_quant)

    # ---- stepping --------------------------------------------------------------------

    def step(self) -> StepOutput:
        """One batch step: new tokens for running sequences, completions for finished ones.

        A sequence's completion comes with the step its last token does, or a later one when
        its KV is still being cut into blocks on the background thread (the last token's
        delta is never held back). With nothing running and no token to hand out, step() waits
        for those cuts.
        """
        output = StepOutput()
        if self._sequences:
            self._step_batch(output)
        # Tokens go out at once: a finished sequence's last token (the first, for max_tokens=1)
        # must not wait for its cache to be cut; the next call waits for the cut instead.
        output.completions += self._collect_cuts(wait=not self._sequences and not output.deltas)
        return output

    def _step_batch(self, output: StepOutput) -> None:
        generated = self._backend.step()
        now = time.perf_counter()
        for item in generated:
            seq = self._sequences.get(item.uid)
            if seq is None:
                continue
            if seq.first_token_at is None:
                seq.first_token_at = now
            token = item.token
            ends_on_stop_token = item.finish_reason == "stop" and token in seq.stop_token_ids
            delta = ""
            if not ends_on_stop_token:
                seq.generated.append(token)
                delta = seq.text.add(token)
                if seq.logprobs is not None and item.logprobs is not None:
                    seq.logprobs.append(item.logprobs)
            completion = None
            if item.finish_reason is not None:
                delta += seq.text.finish()
                reason: FinishReason = "stop" if item.finish_reason == "stop" else "length"
                completion = self._finish(seq, reason)
            elif seq.text.stopped:
                delta += seq.text.finish()
                completion = self._finish(seq, "stop")
            if completion is not None:
                output.completions.append(completion)
            logprobs = None if ends_on_stop_token else item.logprobs  # the stop token is not part of the text
            output.deltas.append(TokenDelta(seq.uid, token, delta, logprobs))

    def cancel(self, uid: int) -> Completion | None:
        """Stop a sequence now and free its blocks; None if it is not running."""
        seq = self._sequences.get(uid)
        if seq is None:
            return None
        return self._finish(seq, "canceled")

    def finish(self, uid: int) -> Completion | None:
        """End a sequence now as if it had stopped by itself (its KV kept): for a caller that reads the
        answer as complete (a repeated tool call). Its completion comes back now or from a later step."""
        seq = self._sequences.get(uid)
        if seq is None:
            return None
        return self._finish(seq, "stop")

    def _finish(self, seq: _Sequence, reason: FinishReason) -> Completion | None:
        """The sequence's completion, or None when its cache is being cut in the background
        (its blocks stay reserved in the pool until the copy is done)."""
        del self._sequences[seq.uid]
        want_kv = seq.keep_cache and reason != "canceled"
        kv = self._backend.finish(seq.uid, want_kv)
        if kv is not None and self.kv_quant is not None:
            quantized = quantized_host_layers(kv.layers, len(kv.tokens))  # MLX calls stay on this thread
            blocks = self._cutter.submit(
                copy_quantized_into_blocks, quantized, list(kv.tokens), self.spec, self.kv_quant
            )
            self._cuts.append(_Cut(seq, reason, kv, blocks))
            return None
        if kv is not None and self.spec.all_full_attention:
            host = host_layers(kv.layers, len(kv.tokens), self.spec)  # MLX calls stay on this thread
            blocks = self._cutter.submit(
                copy_into_blocks, host, list(kv.tokens), self.spec, self._slab, background=True
            )
            self._cuts.append(_Cut(seq, reason, kv, blocks))
            return None
        self.pool.free(seq.uid)
        cache = None
        if kv is not None:
            cache = self._cut_into_blocks(kv)
        return self._completion(seq, reason, cache)

    def _collect_cuts(self, wait: bool) -> list[Completion]:
        done = []
        for cut in list(self._cuts):
            if not (wait or cut.blocks.done()):
                continue
            self._cuts.remove(cut)
            try:
                cache = cut.blocks.result()
            finally:
                self._backend.release(cut.kv)
                self.pool.free(cut.seq.uid)
            done.append(self._completion(cut.seq, cut.reason, cache))
        return done

    def _completion(self, seq: _Sequence, reason: FinishReason, cache: AgentCache | None) -> Completion:
        now = time.perf_counter()
        return Completion(
            uid=seq.uid,
            agent_id=seq.agent_id,
            text=seq.text.text,
            token_ids=list(seq.generated),
            finish_reason=reason,
            usage=Usage(
                prompt_tokens=len(seq.prompt_tokens),
                reused_tokens=seq.reused_tokens,
                prefilled_tokens=len(seq.prompt_tokens) - seq.reused_tokens,
                generated_tokens=len(seq.generated),
            ),
            cache=cache,
            time_to_first_token_s=None
            if seq.first_token_at is None
            else seq.first_token_at - seq.submitted_at,
            total_time_s=now - seq.submitted_at,
            logprobs=seq.logprobs,
        )

    def _cut_into_blocks(self, kv: FinishedKV) -> AgentCache:
        try:
            return caches_to_blocks(kv.layers, kv.tokens, self.spec, self._slab, kv.checkpoints)
        finally:
            self._backend.release(kv)

    def memory(self) -> dict[str, int]:
        """Bytes the engine holds, by kind: where a worker's memory goes (`kvrq status`, the soak).

        mlx_active covers the model's weights, running sequences' KV and the arena's idle
        buffers (MLX arrays too); mlx_cache is what MLX's allocator keeps of freed buffers;
        slab_* is host memory of extracted blocks (lent: in completions, the hot tier or
        pending writes; idle: kept for reuse).
        """
        arena = self._backend.arena if isinstance(self._backend, RaggedBackend) else None
        per_slot = self._slab.bytes_per_block
        self._slab.reclaim()
        return {
            "mlx_active": int(mx.get_active_memory()),
            "mlx_cache": int(mx.get_cache_memory()),
            "arena_idle": arena.idle_bytes if arena is not None else 0,
            "slab_lent": self._slab.lent_slots * per_slot,
            "slab_idle": self._slab.idle_slots * per_slot,
        }

    def prompt_tokens_processed(self) -> int:
        """Prompt tokens the model has run so far (for tests and stats).

        The last prompt token of each sequence is fed by the first decode step and is not counted here.
        """
        return self._backend.prompt_tokens_processed()

    def close(self) -> None:
        self._collect_cuts(wait=True)
        self._cutter.shutdown(wait=True)
        self._backend.close()
