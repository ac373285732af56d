"""The engine step (run, then postprocess): one `engine.step()`, its StepOutput absorbed into each
row's stream events, and the rows that ended handed back as endings for the loop to write.

The step publishes (buffered; the loop flushes) and decides nothing else: an ending is returned, so
the one ending path (worker/loop/endings.py) stays the only writer of outcomes.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import traceback
from collections.abc import Iterator
from typing import TYPE_CHECKING

from producer.wire.protocol import ErrorCode
from worker.loop.held import HeldJob
from worker.loop.outcomes import Ending, Failed, Finished
from worker.loop.parts import LoopParts
from worker.loop.timeline import mark

if TYPE_CHECKING:
    from engine.core.results import Completion, StepOutput
    from worker.requests.output_split import Piece

log = logging.getLogger("kvrq.worker")


class Stepper:
    def __init__(self, parts: LoopParts) -> None:
        self.parts = parts

    def step(self) -> Iterator[Ending]:
        """Run one step; yields the rows that ended (lazily: each is ended before the next is looked at)."""
        clock = self.parts.clock
        try:
            clock.count += 1
            clock.started, cpu = time.time(), time.process_time()
            output = self.parts.engine.step()
            clock.cpu = (clock.cpu[1], time.process_time() - cpu)
            clock.seconds = time.time() - clock.started
        except Exception:
            # One forward pass serves the whole batch: a failed step fails every job in it.
            reason = traceback.format_exc()
            log.error("engine step failed; failing %d running job(s)", len(self.parts.scheduler.running))
            for held in list(self.parts.scheduler.running.values()):
                yield held, Failed(ErrorCode.ENGINE_ERROR, reason, retry=True)
            return
        yield from self.absorb(output)

    def absorb(self, output: StepOutput) -> Iterator[Ending]:
        """Each row's tokens to its stream; the rows that completed (or repeated a tool call) end.

        A row that repeats a call ends there, as a call (finish "stop", read as tool_calls): where a
        drafted step wrote several of its tokens at once, those after the repeat are dropped, even when
        the engine ended the row in the same step (on its max_tokens: the answer still ends as a call)."""
        mono = time.monotonic()
        repeating: list[HeldJob] = []
        for delta in output.deltas:
            held = self.parts.scheduler.by_uid(delta.uid)
            if held is None or held.answer_tokens is not None:
                continue
            held.generated += 1
            self.parts.counts["tokens"] += 1
            if held.generated == 1:
                held.timeline.update(
                    step_started=self.parts.clock.started,
                    step_cpu=self.parts.clock.cpu[1],
                    step_before_cpu=self.parts.clock.cpu[0],
                )
                mark(held, "first_token", self.parts.clock.count)
            text = delta.text if held.output is None else self._split(held, held.output.feed(delta.text))
            if held.output is not None and held.output.repeated_call:
                held.answer_tokens = held.generated  # the answer ends with this token
                repeating.append(held)  # only rows that wrote this step can have just repeated a call
            self.parts.publisher.delta(held.id, text, delta.token)
            if delta.logprobs is not None:
                entry = self.parts.logprob_format(delta.token, delta.logprobs)
                self.parts.publisher.data(held.id, "logprobs", entry.model_dump(mode="json"))
            if mono - held.progress_at >= self.parts.settings.progress_interval:
                held.progress_at = mono
                timeline = {"timeline": held.timeline} if held.generated == 1 else {}
                self.parts.publisher.progress(held.job, generated_tokens=held.generated, **timeline)
        completions = list(output.completions)
        ended = {completion.uid for completion in completions}
        for held in repeating:
            assert held.output is not None and held.uid is not None
            held.output.repeated_call = False  # asked once: its completion comes now or with a step
            if held.uid not in ended and (completion := self.parts.engine.finish(held.uid)) is not None:
                completions.append(completion)
        for completion in completions:
            held = self.parts.scheduler.by_uid(completion.uid)
            if held is not None:
                if held.answer_tokens is not None:
                    completion = answer_ended_at(completion, held.answer_tokens)
                if held.output is not None and (rest := self._split(held, held.output.finish())):
                    self.parts.publisher.delta(held.id, rest, None)
                yield held, Finished(completion)

    def _split(self, held: HeldJob, pieces: list[Piece]) -> str:
        """Publish the reasoning and tool calls among `pieces` as their own events; the answer text."""
        text = []
        for piece in pieces:
            if piece.kind == "reasoning":
                self.parts.publisher.reasoning(held.id, piece.text)
            elif piece.call is not None:
                self.parts.publisher.data(held.id, "tool_call", piece.call.model_dump(mode="json"))
            else:
                text.append(piece.text)
        return "".join(text)


def answer_ended_at(completion: Completion, tokens: int) -> Completion:
    """`completion` cut to its first `tokens` generated tokens, ended as an answer that stopped there.

    Its cache keeps every token the engine wrote: the next turn resumes from what it shares with it."""
    kept = completion.token_ids[:tokens]
    dropped = len(completion.token_ids) - len(kept)
    usage = dataclasses.replace(
        completion.usage, generated_tokens=completion.usage.generated_tokens - dropped
    )
    logprobs = None if completion.logprobs is None else completion.logprobs[:tokens]
    return dataclasses.replace(
        completion, token_ids=kept, finish_reason="stop", usage=usage, logprobs=logprobs
    )
