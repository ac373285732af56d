"""Admission: which held jobs enter the engine now, and with what cache.

`admit` offers what the scheduler's policy allows to the engine; for each, `ready` answers
`Ready | Wait | Outcome`: its agent's turn taken and its cache (or shared prefix, or stored
conversation) read, still waiting (the reason is published in its progress), or ended (an Outcome,
handed back to the loop as an Ending). Reads run on the store's threads; nothing here blocks but
`await_reads`, which gives the reads begun this pass a bounded moment before the batch steps.
"""

from __future__ import annotations

import logging
import time
import traceback
import weakref
from collections.abc import Iterator
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.core.errors import CacheMismatchError, InvalidRequestError, PoolExhaustedError
from producer.wire.protocol import ErrorCode
from worker.jobs.payload import JobRejected
from worker.loop.held import HeldJob
from worker.loop.outcomes import Ending, Failed, Outcome
from worker.loop.parts import LoopParts
from worker.loop.timeline import mark
from worker.requests import stored_conversations
from worker.requests.prepare import prepare
from worker.requests.prompts import PromptError

if TYPE_CHECKING:
    from engine.core.blocks import AgentCache

log = logging.getLogger("kvrq.worker")

#: A busy batch waits this share of its last step, once per read, for cache reads taken this pass.
READ_WAIT_FRACTION = 0.25


@dataclass(frozen=True)
class Ready:
    """Its turn and cache are in: submit it."""


@dataclass(frozen=True)
class Wait:
    """Not yet: `reason` is what it waits for (published as its progress' `waiting_for`)."""

    reason: str


READY = Ready()


class Admitter:
    def __init__(self, parts: LoopParts) -> None:
        self.parts = parts
        self.awaited: weakref.WeakSet[Future[Any]] = weakref.WeakSet()  # reads a step already waited for

    def admit(self) -> Iterator[Ending]:
        """Submit what the scheduler offers and the engine takes, once the agent's turn and cache are
        in; yields the jobs that end instead (lazily: each is ended before the next is offered)."""
        for held, verdict in self.parts.scheduler.admissions(self.parts.engine):
            if verdict.verdict == "later":
                self._show(held, Wait(verdict.reason))
                continue
            if verdict.verdict == "never":
                yield held, Failed(ErrorCode.CONTEXT_LENGTH_EXCEEDED, self._submit_error(held), retry=False)
                continue
            ready = self.ready(held)
            if isinstance(ready, Ready):
                mark(held, "cache_ready", self.parts.clock.count)
                ready = self._submit(held)
            if isinstance(ready, Wait):
                self._show(held, ready)
            elif not isinstance(ready, Ready):
                yield held, ready

    def await_reads(self) -> bool:
        """Give the cache reads begun for jobs just taken a moment before the batch steps; True when
        the caller should admit again. A read still under way when the step starts cost its job a
        whole step (its first token came from the step after next), while a store miss or a disk read
        of a few MB ends in milliseconds (often already over here: it ended during the rest of the
        intake). The batch waits at most READ_WAIT_FRACTION of its last step, once per read."""
        reads = [
            read
            for held in self.parts.scheduler.waiting
            for read in (held.cache, held.source)
            if read is not None
        ]
        if not reads or not self.parts.engine.has_work():
            return False
        pending = [read for read in reads if not read.done() and read not in self.awaited]
        if pending:
            self.awaited.update(pending)
            wait(pending, timeout=READ_WAIT_FRACTION * self.parts.clock.seconds)
        return True

    def ready(self, held: HeldJob) -> Ready | Wait | Outcome:
        """Take the agent's turn and start reading its cache; Ready once both are done (no I/O wait)."""
        if held.agent_id is None:
            return self._prefix_ready(held)
        if self.parts.store is None and not held.extending:
            return READY
        if held.fence is None:
            held.fence = self.parts.turns.take(
                held.agent_id, held.id, held_here={h.id for h in self.parts.scheduler.all()}
            )
            if held.fence is None:
                return Wait("its agent's turn (an earlier job of the agent runs first)")
        if held.extending:
            return self._extend(held)
        if held.cache is None:
            held.cache = self._prefetch(held, held.fence)
        if not held.cache.done():
            return Wait("its agent's cache (reading)")
        return READY

    def _show(self, held: HeldJob, wait: Wait) -> None:
        if held.wait_reason != wait.reason:
            held.wait_reason = wait.reason
            self.parts.publisher.progress(held.job, phase="waiting", waiting_for=wait.reason)

    def _prefix_ready(self, held: HeldJob) -> Ready | Wait:
        """A job without an agent: start reading the longest prefix of its prompt any earlier job of its
        namespace stored; Ready once read (a failed read is a miss: it prefills)."""
        if held.cache is None:
            tenant = held.tenant(self.parts.settings.namespace)
            local = (
                None if self.parts.recent is None else self.parts.recent.longest(held.prompt_tokens, tenant)
            )
            block = self.parts.engine.spec.block_tokens
            full = len(held.prompt_tokens) // block * block  # the most the store's full blocks can give
            if local is not None and local.n_tokens >= full or not self.parts.prefix_reuse:
                held.cache = _done(local)
                return READY
            assert self.parts.store is not None
            try:
                held.cache = self.parts.store.prefetch_prefix(
                    held.prompt_tokens, namespace=held.namespace(self.parts.settings.namespace)
                )
            except Exception:
                log.exception("job %s: reading a shared prefix failed: prefilling", held.id)
                held.cache = _done(local)
                return READY
            held.local_prefix = local
        if not held.cache.done():
            return Wait("a shared prefix (reading)")
        if held.local_prefix is not None:
            stored = self._prefetched(held, held.cache)
            if stored is None or stored.n_tokens < held.local_prefix.n_tokens:
                held.cache = _done(held.local_prefix)
            held.local_prefix = None
        return READY

    def _extend(self, held: HeldJob) -> Ready | Wait | Outcome:
        """A continue / fork job with its turn: once its source is read, render the whole conversation
        and become an ordinary job (Ready when it may be submitted now)."""
        namespace = held.namespace(self.parts.settings.namespace)
        if held.source is None:
            held.source = stored_conversations.start_read(
                self.parts.store, held.request, held.fence, namespace
            )
        if not held.source.done():
            return Wait("its agent's conversation (reading)")
        source = self._prefetched(held, held.source)
        try:
            request, _stored = stored_conversations.resolve(
                self.parts.connection, held.request, source, held.id
            )
            prepared = prepare(self.parts.engine, request)
        except (JobRejected, PromptError) as exc:
            return Failed(ErrorCode.INVALID_REQUEST, f"{type(exc).__name__}: {exc}", retry=False)
        tokens = prepared.prompt_tokens
        verdict = self.parts.engine.admission(len(tokens), prepared.sampling.max_tokens)
        if verdict.verdict == "never":
            reason = stored_conversations.context_message(held.request, len(tokens), verdict.reason)
            return Failed(ErrorCode.CONTEXT_LENGTH_EXCEEDED, reason, retry=False)
        held.stored_messages = len(request.messages or ()) - len(held.request.messages or ())
        held.request, held.prompt_tokens, held.output = request, tokens, prepared.output
        held.sampling = prepared.sampling
        self.parts.engine.reserve(len(tokens), held.sampling.max_tokens)
        cache = stored_conversations.reusable_part(source, tokens)
        if self.parts.recent is not None:  # a new agent (a response's first turn) starts from a recent prefix
            recent = self.parts.recent.longest(tokens, held.tenant(self.parts.settings.namespace))
            if recent is not None and (cache is None or recent.n_tokens > cache.n_tokens):
                cache = recent
        held.cache = _done(cache)
        held.extending = False
        self.parts.publisher.progress(held.job, prompt_tokens=len(tokens))
        # "later": it waits for the engine's room as an ordinary job, not in this pass
        return READY if verdict.verdict == "now" else Wait(held.wait_reason)

    def _prefetch(self, held: HeldJob, fence: int) -> Future[AgentCache | None]:
        """The store's read of the agent's cache, as new as its turn (`fence`) needs; a store that
        raises at once fails only this read."""
        assert self.parts.store is not None and held.agent_id is not None
        try:
            return self.parts.store.prefetch(
                held.agent_id,
                prompt_tokens=held.prompt_tokens,
                fence=fence,
                namespace=held.namespace(self.parts.settings.namespace),
            )
        except Exception as exc:
            failed: Future[AgentCache | None] = Future()
            failed.set_exception(exc)
            return failed

    def _submit(self, held: HeldJob) -> Ready | Wait | Outcome:
        """Into the engine (Ready), or waiting for KV blocks, or ended (the engine refused it)."""
        cache = None if held.cache is None else self._prefetched(held, held.cache)
        admitted_at, admitted_mono = time.time(), time.monotonic()
        try:
            try:
                uid = self._engine_submit(held, cache)
            except CacheMismatchError as exc:
                if cache is None:
                    raise
                log.warning(
                    "job %s: agent %s's saved cache unusable (%s): prefilling", held.id, held.agent_id, exc
                )
                self.parts.counts["cache_read_failed"] += 1
                cache = None
                uid = self._engine_submit(held, None)
        except PoolExhaustedError as exc:
            return Wait(f"KV blocks: {exc}")
        except InvalidRequestError as exc:
            return Failed(ErrorCode.INVALID_REQUEST, f"{type(exc).__name__}: {exc}", retry=False)
        except Exception:
            return Failed(ErrorCode.INTERNAL, traceback.format_exc(), retry=True)
        held.admitted_at = admitted_at
        held.admitted_mono = admitted_mono
        mark(held, "admitted", self.parts.clock.count)
        if held.agent_id is not None and self.parts.store is not None:
            held.cache_hit = cache is not None
        held.wait_reason = ""
        self.parts.scheduler.start(held, uid)
        self.parts.publisher.progress(held.job, phase="running", waiting_for=None, generated_tokens=0)
        return READY

    def _submit_error(self, held: HeldJob) -> str:
        """The engine's own words for a request it can never run (it raises, changing nothing)."""
        try:
            uid = self._engine_submit(held, None)
        except InvalidRequestError as exc:
            return f"{type(exc).__name__}: {exc}"
        self.parts.engine.cancel(uid)  # the verdict said never: not reached
        return "the engine refused the request"

    def _engine_submit(self, held: HeldJob, cache: AgentCache | None) -> int:
        if held.agent_id is not None:
            keep_cache = self.parts.store is not None
        else:
            keep_cache = self.parts.prefix_reuse or self.parts.recent is not None
        return self.parts.engine.submit(
            held.agent_id, held.prompt_tokens, held.sampling, cache=cache, keep_cache=keep_cache
        )

    def _prefetched(self, held: HeldJob, read: Future[AgentCache | None]) -> AgentCache | None:
        """A store read's cache; a failed read is a counted miss (the job prefills instead)."""
        started = time.perf_counter()
        try:
            return read.result()
        except Exception:
            log.exception("job %s: reading agent %s's cache failed: prefilling", held.id, held.agent_id)
            self.parts.counts["cache_read_failed"] += 1
            return None
        finally:
            held.cache_load_s += time.perf_counter() - started


def _done(cache: AgentCache | None) -> Future[AgentCache | None]:
    """A read that is already over (a local match, or nothing to read)."""
    read: Future[AgentCache | None] = Future()
    read.set_result(cache)
    return read
