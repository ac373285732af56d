"""Structured output: a row's grammar (a JSON schema, or a Lark grammar) enforced while it decodes.

llguidance computes, for the row's text so far, the set of tokens that keep it inside the grammar;
the row's logits processor masks every other token to -inf before the row's sampler runs, so what
the row writes is a prefix of a valid document at every step, and the whole document when it ends.
llguidance was chosen over xgrammar (imports torch at top level) and outlines-core (its numpy kernel
needs numba, one row per mask) by measured cost here: a mask is 5-130 us a token on this CPU
(benchmarks/bench_grammar.py), against a 16-row decode step of ~100 ms.

One compiled grammar is kept per distinct source (a small LRU): agents asking for the same schema
turn after turn compile it once. A matcher (the row's position in its grammar) is per row.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

import llguidance
import llguidance.hf
import llguidance.numpy as llnumpy
import mlx.core as mx
import numpy as np

from engine.batch.json_schema import CompiledGrammar, compile_json_schema, grammar_text
from engine.batch.schema_rewrite import rewritten
from engine.core.errors import InvalidRequestError
from engine.core.params import OutputGrammar

_COMPILED_KEPT = 64


class GrammarCompiler:
    """Turns a row's OutputGrammar into its logits processor, with the model's tokenizer.

    The tokenizer's byte table is built on first use (~0.5 s for a 49K vocabulary), not at engine
    start: a worker that never sees a grammar never pays for it.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: frozenset[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[OutputGrammar, CompiledGrammar] = OrderedDict()

    def check(self, grammar: OutputGrammar) -> None:
        """InvalidRequestError naming what llguidance cannot compile; nothing is kept for a bad one."""
        self._compile(grammar)

    def unenforced(self, grammar: OutputGrammar) -> tuple[str, ...]:
        """What the compiled grammar does not enforce (a JSON schema's ignored keywords), one line each."""
        return self._compile(grammar).unenforced

    def processor(self, grammar: OutputGrammar) -> GrammarProcessor:
        tokenizer = self._lltokenizer()
        return GrammarProcessor(
            llguidance.LLMatcher(tokenizer, self._compile(grammar).grammar),
            vocab_size=self._vocab_size or tokenizer.vocab_size,
            grammar_vocab=tokenizer.vocab_size,
            stop_token_ids=self._stop_token_ids,
        )

    def _compile(self, grammar: OutputGrammar) -> CompiledGrammar:
        compiled = self._compiled.get(grammar)
        if compiled is not None:
            self._compiled.move_to_end(grammar)
            return compiled
        compiled = _compiled_grammar(grammar, self._lltokenizer())
        self._compiled[grammar] = compiled
        if len(self._compiled) > _COMPILED_KEPT:
            self._compiled.popitem(last=False)
        return compiled

    def _lltokenizer(self) -> llguidance.LLTokenizer:
        if self._ll_tokenizer is None:
            hf_tokenizer = getattr(self._tokenizer, "_tokenizer", self._tokenizer)
            try:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer)
            except Exception as exc:  # a tokenizer llguidance cannot read: no grammar can run here
                raise InvalidRequestError(
                    f"structured output is not available for this model's tokenizer: {exc}"
                ) from None
        return self._ll_tokenizer


def _compiled_grammar(grammar: OutputGrammar, tokenizer: llguidance.LLTokenizer) -> CompiledGrammar:
    """The grammar checked against the tokenizer, or InvalidRequestError saying why it cannot be enforced."""
    if grammar.kind == "json_schema":
        try:
            schema = json.loads(grammar.source)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"the {grammar.what} is not JSON: {exc}") from None
        try:
            return compile_json_schema(schema, tokenizer)
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(f"the {grammar.what} cannot be enforced: {exc}") from None
    text = str(llguidance.grammar_from("lark", grammar.source))
    problem = llguidance.LLMatcher.validate_grammar(text, tokenizer)
    if problem:
        raise InvalidRequestError(f"the {grammar.what} cannot be enforced: {problem.strip()}")
    return CompiledGrammar(text)


def json_schema_grammar(schema: Any) -> str:
    """llguidance's grammar for a JSON schema, with kvrq's whitespace rule and compile options (not
    validated: llguidance.LLMatcher.validate_grammar says whether it can be enforced)."""
    return grammar_text(rewritten(schema))


class GrammarProcessor:
    """One row's grammar as an mlx-lm logits processor: masks the logits to what the grammar allows.

    The row's sampled tokens reach it twice: as the new tail of the tokens `__call__` is given (mlx-lm's
    generate_step, and its BatchGenerator, which may ask for the next mask before it reports the token)
    and through `ends_row` (both backends call it for every token of a row that has it). Each token is
    consumed once, by whichever comes first. Once the grammar is complete (nothing may follow),
    `ends_row` ends the row at once: the answer is the document, with no wait for an end token.
    """

    def __init__(
        self,
        matcher: llguidance.LLMatcher,
        *,
        vocab_size: int,
        grammar_vocab: int,
        stop_token_ids: frozenset[int],
    ) -> None:
        self.matcher = matcher
        self._vocab_size = vocab_size
        self._grammar_vocab = min(grammar_vocab, vocab_size)
        self._stop_ids = np.array(sorted(t for t in stop_token_ids if t < vocab_size), dtype=np.int64)
        self._bitmask = llnumpy.allocate_token_bitmask(1, grammar_vocab)
        self._allowed_row = np.zeros((1, vocab_size), dtype=bool)  # refilled each step
        self._prompt_length: int | None = None
        self._consumed = 0  # generated tokens the matcher has taken
        self._reported = 0  # generated tokens ends_row was told of

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        length = int(tokens.shape[-1]) if tokens is not None else 0
        if self._prompt_length is None:
            self._prompt_length = length
        else:
            fresh = length - self._prompt_length - self._consumed
            if fresh > 0:  # tokens ends_row has not been told of yet
                new_tokens: list[int] = tokens.reshape(-1)[-fresh:].tolist()  # type: ignore[assignment]
                for token in new_tokens:
                    self._consume(token)
        allowed = mx.array(self._allowed())
        return mx.where(allowed, logits, mx.array(-float("inf"), dtype=logits.dtype))

    def draft_masks(self, draft: list[int]) -> tuple[list[int], np.ndarray]:
        """For a drafted step (engine/batch/speculation.py): the longest prefix of `draft` the grammar
        admits, and the allowed tokens at each of its positions and the one after it ((kept + 1, vocab)):
        position i's mask is the grammar's state after the row's tokens and the first i drafts, which is
        the state in which position i's token counts. A draft stops before an end token, or where the
        document is complete. The matcher is left where it was (the drafts are rolled back)."""
        masks = [self._allowed().copy()]
        kept: list[int] = []
        for token in draft:
            if (
                token >= self._vocab_size
                or not masks[-1][0, token]
                or token in self._stop_ids
                or not self.matcher.consume_token(token)
            ):
                break
            kept.append(token)
            masks.append(self._allowed().copy())
        if kept:
            self.matcher.rollback(len(kept))
        return kept, np.concatenate(masks)

    def ends_row(self, token: int) -> bool:
        self._reported += 1
        if self._reported > self._consumed:
            self._consume(token)
        return bool(self.matcher.is_stopped())

    def _consume(self, token: int) -> None:
        self._consumed += 1
        if self.matcher.is_stopped() or token in self._stop_ids:
            return  # an end token after the document, or the row ends on it anyway
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"grammar rejected token {token}: {self.matcher.get_error()}")

    def _allowed(self) -> np.ndarray:
        """A boolean row over the model's vocabulary; end tokens only where the document may end."""
        allowed = self._allowed_row
        allowed[:] = False
        if not self.matcher.is_stopped():
            llnumpy.fill_next_token_bitmask(self.matcher, self._bitmask, 0)
            bits = np.unpackbits(self._bitmask[0].view(np.uint8), bitorder="little")
            allowed[0, : self._grammar_vocab] = bits[: self._grammar_vocab].astype(bool)
        if self.matcher.is_accepting() or self.matcher.is_stopped() or not allowed.any():
            allowed[0, self._stop_ids] = True
        else:
            allowed[0, self._stop_ids] = False
        return allowed
