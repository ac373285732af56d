"""Where a decoding row's draft comes from: its own context (prompt lookup, NgramIndex) or a small
draft model run ahead of it (DraftModel). A drafter only proposes; the speculation policy
(engine/batch/speculation.py) decides which rows draft and the step verifies them.

Why two: agent answers copy long spans of their context, where a lookup is free and often right;
prose and fresh code are not in the context, where only a model can guess, at a price (k small
forwards a drafted row). A tool call's arguments are JSON strings: a file the agent read is in its
context as plain text and comes back escaped (newlines as \\n, quotes as \\"), in other tokens, so
the lookup also reads the context as it would be quoted (QuotedContext).

A model's own MTP head would be a third drafter: mlx-lm 0.32 drops the MTP weights of every model
that ships them (deepseek_v3, glm4_moe, qwen3_next, qwen3_5, mimo) when it loads them, so there is
none to run yet.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any, Protocol

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache, trim_prompt_cache

#: n-gram sizes looked up in a row's context, longest first.
NGRAM_SIZES = (4, 3, 2)
#: An n-gram's latest occurrences kept: the draft follows the one whose tokens before it match the
#: row's own furthest back (code repeats its n-grams: `\n\ndef `, `path: Path = DATA`).
OCCURRENCES = 8
#: How far back those matches are compared.
MATCH_TOKENS = 32
#: Prompt tokens a draft model reads per forward while it catches up with a row's context.
CATCH_UP_CHUNK = 512
#: Context tokens (the latest) a row's quoted view covers: building it decodes, escapes and
#: tokenizes them again, 27-30 ms for 9K tokens of SmolLM2's tokenizer on this CPU, once a row.
QUOTED_CONTEXT_TOKENS = 8192
#: A row's latest tokens that must hold a backslash before its quoted view is built: it is writing
#: inside a JSON string.
ESCAPE_TAIL_TOKENS = 4


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


Occurrences = dict[tuple[int, ...], list[int]]


def index_ngrams(tokens: Sequence[int], start: int, end: int, into: Occurrences) -> None:
    """Record, for each n-gram ending at positions start..end-1, that position (its latest
    OCCURRENCES, oldest first)."""
    for i in range(start, end):
        for n in NGRAM_SIZES:
            if i + 1 >= n:
                ends = into.setdefault(tuple(tokens[i + 1 - n : i + 1]), [])
                ends.append(i)
                if len(ends) > OCCURRENCES:
                    del ends[0]


def matched(a: Sequence[int], i: int, b: Sequence[int], j: int) -> int:
    """How many tokens ending at a[i] equal those ending at b[j] (up to MATCH_TOKENS)."""
    n = 0
    while n < MATCH_TOKENS and n <= min(i, j) and a[i - n] == b[j - n]:
        n += 1
    return n


class QuotedContext:
    """A row's context as it reads inside a JSON string, in tokens, and its n-grams: where the row
    writes a tool call quoting a file it was shown, its last tokens are found here, not in the
    context itself. Built once, when the row's output first holds a backslash; it covers the
    context up to then (QUOTED_CONTEXT_TOKENS of it)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self._ends: Occurrences | None = None
        self._seen = 0  # context tokens looked at for escapes

    def ready(self, context: Sequence[int]) -> bool:
        """Whether the view is built, building it where the tokens the context gained since the last
        call (at first, its last ESCAPE_TAIL_TOKENS) hold escaped text."""
        if self._ends is None:
            start = self._seen - 1 if self._seen else len(context) - ESCAPE_TAIL_TOKENS
            fresh = context[max(0, start) :]
            self._seen = len(context)
            if "\\" in self.tokenizer.decode(list(fresh)):
                text = self.tokenizer.decode(list(context[-QUOTED_CONTEXT_TOKENS:]))
                quoted = json.dumps(text, ensure_ascii=False)[1:-1]
                self.tokens = list(self.tokenizer.encode(quoted))  # a BOS, if any, is one stray token
                self._ends = {}
                index_ngrams(self.tokens, 0, len(self.tokens) - 1, self._ends)
        return self._ends is not None

    def ends(self, ngram: tuple[int, ...]) -> list[int]:
        """Where the n-gram's latest occurrences in the quoted context end, oldest first."""
        return [] if self._ends is None else self._ends.get(ngram, [])


class NgramIndex:
    """A row's context (append-only) and, for each n-gram, where it last ended before the last
    token: the lookup is a dict read a step, not a scan of the context. With a tokenizer, the
    context as quoted in a JSON string too (QuotedContext)."""

    token_s = 0.0

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokens: list[int] = []
        self._ends: Occurrences = {}
        self._indexed = 0  # n-grams ending before this position are in _ends
        self._quoted = None if tokenizer is None else QuotedContext(tokenizer)

    def draft(self, context: Sequence[int], k: int) -> list[int]:
        self.sync(context)
        return self.propose(k)

    def behind(self, n_context: int) -> int:
        return 0

    def sync(self, context: Sequence[int]) -> None:
        """Take in the context's new tokens (`context` extends what came before)."""
        self.tokens.extend(context[len(self.tokens) :])

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed an earlier occurrence of the context's last n-gram, longest
        n-gram first: the occurrence (in the context, or in its quoted view) whose tokens before it
        match the context's furthest back; on a tie the latest, the context's before the view's."""
        tokens, end = self.tokens, len(self.tokens) - 1
        index_ngrams(tokens, self._indexed, end, self._ends)
        self._indexed = max(self._indexed, end)
        quoted = self._quoted if self._quoted is not None and self._quoted.ready(tokens) else None
        for n in NGRAM_SIZES:
            if end + 1 >= n:
                ngram = tuple(tokens[end + 1 - n :])
                found = [(tokens, at) for at in reversed(self._ends.get(ngram, []))]
                if quoted is not None:
                    found += [(quoted.tokens, at) for at in reversed(quoted.ends(ngram))]
                if found:
                    source, at = max(found, key=lambda place: matched(place[0], place[1], tokens, end))
                    return list(source[at + 1 : at + 1 + k])
        return []


class PromptLookup:
    """Drafts from the row's own context: the default drafter. `tokenizer` (its `decode` and
    `encode`): the context quoted in a JSON string is looked up too."""

    runs_a_model = False
    token_s = prompt_token_s = 0.0

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer

    def for_row(self) -> RowDrafter:
        return NgramIndex(self.tokenizer)


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
