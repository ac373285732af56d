"""Where a decoding row's draft comes from: its own context (prompt lookup, NgramIndex) or a small
draft model run ahead of it (DraftModel). A drafter only proposes; the speculation policy
(engine/batch/speculation.py) decides which rows draft and the step verifies them.

Why two: agent answers copy long spans of their context, where a lookup is free and often right;
prose and fresh code are not in the context, where only a model can guess, at a price (k small
forwards a drafted row). A model's own MTP head would be a third drafter: mlx-lm 0.32 drops the
MTP weights of every model that ships them (deepseek_v3, glm4_moe, qwen3_next, qwen3_5, mimo) when
it loads them, so there is none to run yet.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache, trim_prompt_cache

#: n-gram sizes looked up in a row's context, longest first.
NGRAM_SIZES = (4, 3, 2)
#: Prompt tokens a draft model reads per forward while it catches up with a row's context.
CATCH_UP_CHUNK = 512


class RowDrafter(Protocol):
    """One row's source of drafts. `token_s`: what its latest draft took per token, catching up with
    the context aside (0 for a lookup): the price the policy adds to a draft token."""

    token_s: float

    def behind(self, n_context: int) -> int:
        """Context tokens it must read before its next draft (0 for a lookup)."""
        ...

    def draft(self, context: Sequence[int], k: int) -> list[int]:
        """Up to k tokens likely to follow `context` (the row's prompt and output so far, which only
        grows between calls); [] where there is no guess."""
        ...


class Drafter(Protocol):
    """Makes each row's RowDrafter. `runs_a_model`: a draft costs forwards, so the policy asks for
    drafts only from the rows it picked (a lookup is free: every row is asked, and offers only what
    it finds). `token_s` and `prompt_token_s`: what guessing a token and reading a context token
    cost, timed once when it is made (0 for a lookup): the policy's prices before rows are timed."""

    runs_a_model: bool
    token_s: float
    prompt_token_s: float

    def for_row(self) -> RowDrafter: ...


class NgramIndex:
    """A row's context (append-only) and, for each n-gram, where it last ended before the last
    token: the lookup is a dict read a step, not a scan of the context."""

    token_s = 0.0

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self._last: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this position are in _last

    def draft(self, context: Sequence[int], k: int) -> list[int]:
        self.sync(context)
        return self.propose(k)

    def behind(self, n_context: int) -> int:
        return 0

    def sync(self, context: Sequence[int]) -> None:
        """Take in the context's new tokens (`context` extends what came before)."""
        self.tokens.extend(context[len(self.tokens) :])

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the context's last n-gram."""
        tokens, end = self.tokens, len(self.tokens) - 1
        for i in range(self._indexed, end):
            for n in NGRAM_SIZES:
                if i + 1 >= n:
                    self._last[tuple(tokens[i + 1 - n : i + 1])] = i
        self._indexed = max(self._indexed, end)
        for n in NGRAM_SIZES:
            if end + 1 >= n:
                at = self._last.get(tuple(tokens[end + 1 - n :]))
                if at is not None:
                    return tokens[at + 1 : at + 1 + k]
        return []


class PromptLookup:
    """Drafts from the row's own context: the default drafter."""

    runs_a_model = False
    token_s = prompt_token_s = 0.0

    def for_row(self) -> RowDrafter:
        return NgramIndex()


class DraftModel:
    """Drafts from a small model of the same vocabulary, greedily: each row keeps its own cache of
    the draft model, which follows the row's context and is trimmed back to it after a rejection."""

    runs_a_model = True

    def __init__(self, model: Any, vocab_size: int) -> None:
        draft_vocab = int(getattr(getattr(model, "args", None), "vocab_size", 0) or 0)
        if draft_vocab != vocab_size:
            raise ValueError(
                f"the draft model's vocabulary has {draft_vocab} tokens, the model's {vocab_size}: "
                "a draft model must share the model's tokenizer"
            )
        if not all(type(layer) is KVCache for layer in make_prompt_cache(model)):
            raise ValueError(
                f"{type(model).__module__} keeps caches a trim cannot roll back (sliding window, SSM): "
                "a draft model needs full attention"
            )
        self.model = model
        self.token_s, self.prompt_token_s = time_draft_model(model)

    def for_row(self) -> RowDrafter:
        return DraftModelRow(self.model)


def time_draft_model(model: Any, tokens: int = 16, guesses: int = 4) -> tuple[float, float]:
    """Seconds a draft model takes per guessed token and per context token read, from one short
    draft (a second one: the first also warms it up)."""
    context = [1 + i % 200 for i in range(tokens)]
    token_s = read_s = 0.0
    for _ in range(2):
        row = DraftModelRow(model)
        started = time.perf_counter()
        row.draft(context, guesses)
        token_s = row.token_s
        read_s = time.perf_counter() - started - token_s * guesses
    return token_s, max(0.0, read_s) / tokens


class DraftModelRow:
    """One row's draft-model cache and the tokens in it."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.cache = make_prompt_cache(model)
        self.tokens: list[int] = []  # what the cache holds, in order
        self._verified = 0  # tokens[:_verified] is known to be a prefix of the row's context
        self.token_s = 0.0

    def behind(self, n_context: int) -> int:
        return max(0, n_context - len(self.tokens))

    def draft(self, context: Sequence[int], k: int) -> list[int]:
        if k <= 0 or not context:
            return []
        self._rewind(context)
        logits = self._read(context[len(self.tokens) :])
        mx.eval(logits)  # the catch-up, done: the guesses alone are timed
        started = time.perf_counter()
        guesses = [mx.argmax(logits, axis=-1)]
        for _ in range(k - 1):
            logits = self.model(guesses[-1][None, None], cache=self.cache)[0, -1]
            guesses.append(mx.argmax(logits, axis=-1))
        drafted: list[int] = mx.stack(guesses).tolist()  # type: ignore[assignment]
        self.token_s = (time.perf_counter() - started) / k
        self.tokens = [*context, *drafted[:-1]]  # the last guess was never fed
        self._verified = len(context)
        return drafted

    def _rewind(self, context: Sequence[int]) -> None:
        """Trim the cache back to the longest prefix it shares with the context, and at least one
        token short of it: the last context token is read again for the logits after it."""
        keep = self._verified
        limit = min(len(self.tokens), len(context) - 1)
        while keep < limit and self.tokens[keep] == context[keep]:
            keep += 1
        keep = min(keep, limit)
        if len(self.tokens) > keep:
            trim_prompt_cache(self.cache, len(self.tokens) - keep)
            del self.tokens[keep:]

    def _read(self, tokens: Sequence[int]) -> mx.array:
        """Feed `tokens` (at least one) into the cache in chunks; the logits after the last one."""
        start = 0
        while len(tokens) - start > CATCH_UP_CHUNK:
            self.model(mx.array(list(tokens[start : start + CATCH_UP_CHUNK]))[None], cache=self.cache)
            mx.eval([layer.state for layer in self.cache])
            start += CATCH_UP_CHUNK
        return self.model(mx.array(list(tokens[start:]))[None], cache=self.cache)[0, -1]
