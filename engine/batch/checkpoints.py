"""CheckpointingBatchBackend: mlx-lm's BatchGenerator, plus a copy of every SSM / linear-attention
state each time a sequence passes a block boundary (every 256 tokens of the sequence).

An ArraysCache holds one state for the whole history and cannot be trimmed back to an earlier
token, so a later turn whose prompt shares only part of the history could not resume at all.
With a checkpoint at each block end the next turn resumes from the last boundary inside the
shared prefix (AgentCache.resume_point). Prompts are inserted as segments ending on those
boundaries (BatchGenerator.insert_segments stops prefill there), and the state is copied once
the segment has run; during generation, at the step whose token completes a block. A resumed
sequence keeps the checkpoints of the cache it resumed from, up to where it resumed.
"""

from __future__ import annotations

from typing import Any

from mlx_lm.generate import StopSequences

from engine.batch.backends import FinishedKV, GeneratedToken, MlxBatchBackend
from engine.batch.sampling import Sampler
from engine.core.blocks import AgentCache
from engine.core.params import LogitsProcessor
from engine.core.spec import ModelCacheSpec
from engine.kv.convert import blocks_to_caches
from engine.kv.layered import Checkpoint, inherited_checkpoints, take_checkpoint


class CheckpointingBatchBackend(MlxBatchBackend):
    def __init__(self, model: Any, spec: ModelCacheSpec, *, max_batch: int, prefill_step_size: int) -> None:
        super().__init__(model, max_batch=max_batch, prefill_step_size=prefill_step_size)
        self.spec = spec
        self._checkpoints: dict[int, dict[int, Checkpoint]] = {}
        self._covered: dict[int, int] = {}  # tokens in a generating sequence's cache

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
        (uid,) = self.generator.insert_segments(
            [block_segments(prompt, reused, self.spec.block_tokens)],
            max_tokens=[max_tokens],
            caches=layer_caches,
            all_tokens=[prompt[:reused]],
            samplers=[sampler],  # type: ignore[list-item]
            logits_processors=[list(processors or ())],
            stop_sequences=[StopSequences([[t] for t in sorted(stop_token_ids)])],
        )
        uid = int(uid)
        self._follow(uid, processors, top_logprobs)
        self._checkpoints[uid] = inherited_checkpoints(cache, reused) if cache is not None else {}
        self._covered[uid] = len(prompt)
        return uid

    def step(self) -> list[GeneratedToken]:
        prompt_responses, responses = self.generator.next()
        for progress in prompt_responses:
            if progress.end_of_segment and not progress.end_of_prompt:
                self._checkpoint(progress.uid)
        out = []
        for response in responses:
            uid = int(response.uid)
            if response.finish_reason is None and uid in self._covered:
                self._covered[uid] += 1
                if self._covered[uid] % self.spec.block_tokens == 0:
                    self._checkpoint(uid)
            out.append(self._generated(response))
        return out

    def _checkpoint(self, uid: int) -> None:
        """Copy the sequence's state if its cache now ends exactly on a block boundary."""
        extracted = self.generator.extract_cache([uid]).get(uid)
        if extracted is None:
            return
        layers, tokens = extracted
        position = len(tokens)
        if position and position % self.spec.block_tokens == 0:
            self._checkpoints.setdefault(uid, {})[position] = take_checkpoint(layers, self.spec)

    def finish(self, uid: int, want_kv: bool) -> FinishedKV | None:
        kv = super().finish(uid, want_kv)
        checkpoints = self._checkpoints.pop(uid, {})
        self._covered.pop(uid, None)
        if kv is None:
            return None
        return FinishedKV(kv.layers, kv.tokens, checkpoints)


def block_segments(prompt: list[int], reused: int, block_tokens: int) -> list[list[int]]:
    """The prompt after `reused`, cut so that each piece ends on a block boundary of the sequence."""
    cuts = list(range((reused // block_tokens + 1) * block_tokens, len(prompt), block_tokens))
    edges = [reused, *cuts, len(prompt)]
    return [prompt[a:b] for a, b in zip(edges, edges[1:], strict=False) if b > a]
