"""StepCost: what a step of the ragged batch costs on this machine, learnt from the steps it runs,
and how many prompt tokens of finishing rows a step should therefore carry.

Why: when several warm agents join at once (a restart, a burst of turns), their suffixes all fit in
one step, and one step is what the batch used to give them: every first token came at the end of a
step carrying all of them. A step costs a fixed part `a` (the weights read once, the decoding rows)
plus `b` per prompt token. Finishing n suffixes of W tokens in all, J tokens a step, the mean first
token is about (a + bJ)(W/J + 1)/2, least at J = sqrt(aW/b). On a 2-core CPU (a ~0.06 s, b ~4.5 ms
a token for SmolLM2) twelve 20-token suffixes go ~3 a step, not 12 at once; where a prompt token
costs little against the fixed part (a worth a few hundred tokens: a GPU), J covers the whole burst,
as before.

The mean is flat near that least J, the median is not: the burst's median agent gets its first token
at the end of the first step only if that step finishes the shortest half of the burst and one more.
So the first step carries that half where it costs the mean at most MEDIAN_SLACK over its least
(on the 2-core CPU, twelve returning agents: the mean +2-7%, the median -20-30%); a burst so large
that its half would cost the mean more (a hundred agents at once) keeps the mean's J.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

#: Weight of the newest step in the running averages.
WEIGHT = 0.2
#: A step with fewer prompt tokens says too little about their cost to count.
MIN_PROMPT_TOKENS = 16
#: How much above its least the mean first token may go for the median's sake.
MEDIAN_SLACK = 0.1


class StepRecord(Protocol):
    prompt_tokens: int
    decode_rows: int
    forward_s: float


class StepCost:
    def __init__(self) -> None:
        self.fixed_s: float | None = None  # a step with decoding rows only
        self.per_token_s: float | None = None  # each prompt token on top
        self.prefill_token_s: float | None = None  # a prompt-only step's time per token

    def record(self, step: StepRecord) -> None:
        if step.forward_s <= 0:
            return
        if step.prompt_tokens == 0 and step.decode_rows > 0:
            self.fixed_s = _average(self.fixed_s, step.forward_s)
        elif step.prompt_tokens >= MIN_PROMPT_TOKENS and self.fixed_s is not None:
            per_token = max(0.0, step.forward_s - self.fixed_s) / step.prompt_tokens
            self.per_token_s = _average(self.per_token_s, per_token)
        elif step.prompt_tokens >= MIN_PROMPT_TOKENS and step.decode_rows == 0:
            self.prefill_token_s = _average(self.prefill_token_s, step.forward_s / step.prompt_tokens)

    @property
    def token_price_s(self) -> float | None:
        """What one more token costs a step: `per_token_s`, else, before any step had both decoding
        rows and prompt tokens (a fresh engine given all its prompts at once), a prompt-only step's
        time per token, which errs high by its share of the step's fixed part."""
        return self.per_token_s if self.per_token_s is not None else self.prefill_token_s

    def join_tokens(self, suffixes: Sequence[int]) -> int | None:
        """Prompt tokens of finishing rows one step should carry, `suffixes` being the prompt tokens
        each waiting row has left; None until both parts of the cost are known (then: no bound)."""
        waiting = sum(suffixes)
        if self.fixed_s is None or not self.per_token_s or waiting <= 0:
            return None
        least = max(1, math.ceil(math.sqrt(self.fixed_s * waiting / self.per_token_s)))
        half = sum(sorted(suffixes)[: len(suffixes) // 2 + 1])  # the median's first step
        if half > least and self.mean_first_token_s(half, waiting) <= (
            1 + MEDIAN_SLACK
        ) * self.mean_first_token_s(least, waiting):
            return half
        return least

    def mean_first_token_s(self, join_tokens: int, waiting_tokens: int) -> float:
        """The burst's mean first token, `join_tokens` a step (needs both parts known)."""
        assert self.fixed_s is not None and self.per_token_s is not None
        step_s = self.fixed_s + self.per_token_s * join_tokens
        return step_s * (waiting_tokens / join_tokens + 1) / 2


def _average(current: float | None, new: float) -> float:
    return new if current is None else (1 - WEIGHT) * current + WEIGHT * new
