"""Incremental detokenization with stop strings.

Text is released only once it can no longer change: a token may end inside a
multi-byte character (decoded as U+FFFD until the next token), and the tail of the
text may be the start of a stop string, which must never reach the reader.

Decoding is windowed: each token decodes only the tokens since the last clean
boundary (plus the previous window, so tokenizers that treat a leading space
specially see the same context), keeping the per-token cost flat over long answers.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()) -> None:
        self._tokenizer = tokenizer
        self._stop = tuple(s for s in stop if s)
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self.tokens: list[int] = []
        self._prefix_offset = 0  # window start: context for the decoder
        self._read_offset = 0  # tokens up to here are already part of _text
        self._text = ""  # decoded text so far, up to a clean character boundary
        self._emitted = 0  # characters of _text already released
        self.stopped = False  # a stop string was found; text ends before it

    def add(self, token: int) -> str:
        """Add one generated token; return the text that became final."""
        if self.stopped:
            return ""
        self.tokens.append(token)
        new_text = self._decode_window()
        if new_text is None:
            return ""
        self._text += new_text
        self._prefix_offset, self._read_offset = self._read_offset, len(self.tokens)
        if self._stop:
            search_from = max(0, self._emitted - self._holdback)
            cut = min(
                (i for i in (self._text.find(s, search_from) for s in self._stop) if i >= 0),
                default=-1,
            )
            if cut >= 0:
                self._text = self._text[:cut]
                self.stopped = True
                return self._release(len(self._text))
        return self._release(len(self._text) - self._holdback)

    def finish(self) -> str:
        """Release everything left (the sequence ended), incomplete characters included."""
        if not self.stopped and self._read_offset < len(self.tokens):
            self._text += self._decode_window(final=True) or ""
            self._read_offset = len(self.tokens)
        return self._release(len(self._text))

    @property
    def text(self) -> str:
        return self._text

    def _decode_window(self, final: bool = False) -> str | None:
        """Text added by tokens after _read_offset, or None while it ends mid-character."""
        before = self._tokenizer.decode(self.tokens[self._prefix_offset : self._read_offset])
        after = self._tokenizer.decode(self.tokens[self._prefix_offset :])
        if not final and (len(after) <= len(before) or after.endswith(REPLACEMENT)):
            return None
        return after[len(before) :]

    def _release(self, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        delta = self._text[self._emitted : upto]
        self._emitted = upto
        return delta
