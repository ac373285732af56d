"""A small in-process engine with the BlockPoolBatchEngine API, for fast tests of the worker loop.

One token per running sequence per step; prompts containing magic words misbehave:
BOOM (submit raises), STEPFAIL (the next step raises).
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from engine.batch.speculation import SpeculationStats
from engine.core.admission import Admission
from engine.core.blocks import AgentCache, BlockPool, common_prefix_length
from engine.core.errors import InvalidRequestError
from engine.core.params import SamplingParams
from engine.core.results import Completion, StepOutput, TokenDelta, Usage
from engine.core.spec import LayerSpec, ModelCacheSpec
from store.base import CacheInfo

SPEC = ModelCacheSpec(
    model_name="fake",
    n_layers=1,
    layers=(LayerSpec("full"),),
    n_kv_heads=1,
    k_head_dim=1,
    v_head_dim=1,
    dtype="float32",
    block_tokens=4,
)
EOS = 0
T = TypeVar("T")


class FakeTokenizer:
    eos_token_ids = {EOS}

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(i) for i in ids if i != EOS)

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool, tokenize: bool
    ) -> Any:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "<assistant>"
        return self.encode(text) if tokenize else text


@dataclass
class _Seq:
    uid: int
    agent_id: str | None
    prompt: list[int]
    reused: int
    max_tokens: int
    generated: list[int] = field(default_factory=list)


class FakeEngine:
    def __init__(self, pool_blocks: int = 64, max_batch: int = 4) -> None:
        self.spec = SPEC
        self.pool = BlockPool(pool_blocks)
        self.tokenizer = FakeTokenizer()
        self.vocab_size = 0
        self.max_batch = max_batch
        self.max_context = 4096
        self._seqs: dict[int, _Seq] = {}
        self._next_uid = 0
        self.submitted: list[tuple[str | None, list[int], int]] = []  # agent, prompt, reused
        self.fail_next_step = False
        self.max_active = 0
        self.reserved: list[tuple[int, int]] = []  # reserve() calls, in order
        self.kept_ready: list[list[int]] = []  # keep_ready() calls
        self.drafting: SpeculationStats | None = None  # speculation off

    def free_slots(self) -> int:
        return self.max_batch - len(self._seqs)

    def speculation_stats(self) -> SpeculationStats | None:
        return self.drafting

    def keep_ready(self, n_tokens: Sequence[int]) -> int:
        self.kept_ready.append(list(n_tokens))
        return len(n_tokens)

    def reserve(self, n_prompt_tokens: int, max_tokens: int) -> bool:
        self.reserved.append((n_prompt_tokens, max_tokens))
        return True

    def check(self, params: SamplingParams) -> None:
        params.validate(self.vocab_size)

    def admission(self, n_prompt_tokens: int, max_tokens: int) -> Admission:
        needed = self.spec.blocks_for(n_prompt_tokens + max_tokens)
        if n_prompt_tokens + max_tokens > self.max_context or needed > self.pool.total_blocks:
            return Admission("never", "too large")
        if self.free_slots() <= 0:
            return Admission("later", "no free slot")
        if not self.pool.can_allocate(needed):
            return Admission("later", "KV blocks")
        return Admission("now")

    def active(self) -> int:
        return len(self._seqs)

    def close(self) -> None:
        pass

    def has_work(self) -> bool:
        return bool(self._seqs)

    def memory(self) -> dict[str, int]:
        return {"mlx_active": 0}

    def submit(
        self,
        agent_id: str | None,
        prompt_tokens: Sequence[int],
        params: SamplingParams,
        *,
        cache: AgentCache | None = None,
        keep_cache: bool = True,
    ) -> int:
        prompt = list(prompt_tokens)
        max_tokens = params.max_tokens
        text = self.tokenizer.decode(prompt)
        if "BOOM" in text:
            raise RuntimeError("kaboom in submit")
        if len(prompt) + max_tokens > self.max_context:
            raise InvalidRequestError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the context"
            )
        uid = self._next_uid
        self.pool.allocate(uid, self.spec.blocks_for(len(prompt) + max_tokens))
        self._next_uid += 1
        reused = 0 if cache is None else min(common_prefix_length(cache.token_ids, prompt), len(prompt) - 1)
        if "STEPFAIL" in text:
            self.fail_next_step = True
        self._seqs[uid] = _Seq(uid, agent_id, prompt, reused, max_tokens)
        self.submitted.append((agent_id, prompt, reused))
        self.max_active = max(self.max_active, len(self._seqs))
        return uid

    def step(self) -> StepOutput:
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("step exploded")
        out = StepOutput()
        for seq in list(self._seqs.values()):
            token = ord("a") + len(seq.generated) % 26
            seq.generated.append(token)
            out.deltas.append(TokenDelta(seq.uid, token, chr(token)))
            if len(seq.generated) >= seq.max_tokens:
                out.completions.append(self._finish(seq, "length"))
        return out

    def cancel(self, uid: int) -> Completion | None:
        seq = self._seqs.get(uid)
        return None if seq is None else self._finish(seq, "canceled")

    def finish(self, uid: int) -> Completion | None:
        seq = self._seqs.get(uid)
        return None if seq is None else self._finish(seq, "stop")

    def _finish(self, seq: _Seq, reason: str) -> Completion:
        del self._seqs[seq.uid]
        self.pool.free(seq.uid)
        tokens = seq.prompt + seq.generated
        cache = None if reason == "canceled" else AgentCache(SPEC, tokens, [])
        return Completion(
            uid=seq.uid,
            agent_id=seq.agent_id,
            text=self.tokenizer.decode(seq.generated),
            token_ids=list(seq.generated),
            finish_reason=reason,  # type: ignore[arg-type]
            usage=Usage(len(seq.prompt), seq.reused, len(seq.prompt) - seq.reused, len(seq.generated)),
            cache=cache,
            time_to_first_token_s=0.001,
            total_time_s=0.002,
        )


class DictStore:
    """A store shared by every worker of a test. With `durable=False` puts stay pending until `settle()`."""

    def __init__(self, durable: bool = True) -> None:
        self.caches: dict[str, AgentCache] = {}
        self.puts: list[str] = []
        self.fences: list[tuple[str, int | None]] = []
        self.prefetches: list[str] = []
        self.pending: list[Future[bool]] = []
        self.durable = durable
        self.closed = False
        self.prefixes: dict[str, list[AgentCache]] = {}  # namespace -> kept prefixes of agent-less jobs
        self.namespaces: list[tuple[str, str | None]] = []  # (agent, namespace) of each put

    def get(self, agent_id: str, *, prompt_tokens: Sequence[int] | None = None) -> AgentCache | None:
        return self.caches.get(agent_id)

    def prefetch(
        self,
        agent_id: str,
        *,
        prompt_tokens: Sequence[int] | None,
        fence: int | None = None,
        namespace: str | None = None,
    ) -> Future[AgentCache | None]:
        self.prefetches.append(agent_id)
        return self.read(agent_id)

    def read(self, agent_id: str) -> Future[AgentCache | None]:
        """A prefetch's read, apart from its bookkeeping: what a failing or slow store overrides."""
        return done(self.get(agent_id))

    def prefetch_prefix(
        self, prompt_tokens: Sequence[int], *, namespace: str | None = None
    ) -> Future[AgentCache | None]:
        """The longest run of full blocks of the prompt among the prefixes kept in `namespace`."""
        best: AgentCache | None = None
        for cache in self.prefixes.get(namespace or "default", []):
            shared = common_prefix_length(cache.token_ids, list(prompt_tokens))
            full = shared // cache.spec.block_tokens * cache.spec.block_tokens
            if full and (best is None or full > best.n_tokens):
                best = AgentCache(cache.spec, cache.token_ids[:full], [])
        return done(best)

    def put_prefix(self, cache: AgentCache, *, namespace: str | None = None) -> Future[bool]:
        self.prefixes.setdefault(namespace or "default", []).append(cache)
        return done(True)

    def put(
        self, agent_id: str, cache: AgentCache, *, fence: int | None = None, namespace: str | None = None
    ) -> Future[bool]:
        self.namespaces.append((agent_id, namespace))
        self.caches[agent_id] = cache
        self.puts.append(agent_id)
        self.fences.append((agent_id, fence))
        if self.durable:
            return done(True)
        future: Future[bool] = Future()
        self.pending.append(future)
        return future

    def stats(self) -> dict[str, int]:
        return {"hot_entries": len(self.caches), "hot_hits": 0, "hot_misses": len(self.prefetches), "hits": 0}

    def list(self) -> builtins.list[str]:
        return sorted(self.caches)

    def info(self, agent_id: str) -> CacheInfo | None:
        cache = self.caches.get(agent_id)
        if cache is None:
            return None
        last_used = float(len(self.puts) - self.puts[::-1].index(agent_id))  # later puts: more recent
        return CacheInfo(agent_id, cache.n_tokens, cache.nbytes, last_used, "none", len(cache.blocks))

    def settle(self) -> None:
        for future in self.pending:
            future.set_result(True)
        self.pending.clear()

    def close(self) -> None:
        self.settle()
        self.closed = True


def done(value: T) -> Future[T]:
    future: Future[T] = Future()
    future.set_result(value)
    return future
