"""Engine logprobs (token ids and floats) in OpenAI's shape: token text, id, logprob, UTF-8 bytes."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from producer.models import TokenLogprob, TopLogprob

if TYPE_CHECKING:
    from engine.core.results import TokenLogprobs

REPLACEMENT = "\ufffd"


class LogprobFormatter:
    """Turns a token's engine logprobs into a TokenLogprob; token texts are decoded once per id."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._text = functools.lru_cache(maxsize=65536)(self._decode)

    def __call__(self, token: int, logprobs: TokenLogprobs) -> TokenLogprob:
        return TokenLogprob(
            **self._entry(token, logprobs.logprob),
            top_logprobs=[TopLogprob(**self._entry(i, value)) for i, value in logprobs.top],
        )

    def _entry(self, token: int, logprob: float) -> dict[str, Any]:
        text, raw = self._text(token)
        return {"token": text, "token_id": token, "logprob": logprob, "bytes": raw}

    def _decode(self, token: int) -> tuple[str, list[int] | None]:
        text = str(self._tokenizer.decode([token]))
        if REPLACEMENT not in text:
            return text, list(text.encode("utf-8"))
        return text, _byte_level_bytes(self._tokenizer, token)


def _byte_level_bytes(tokenizer: Any, token: int) -> list[int] | None:
    """The raw bytes of a token that holds part of a character, where the tokenizer is byte-level BPE
    (GPT-2's byte-to-character table); None where they cannot be told."""
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    if convert is None:
        return None
    piece = convert(token)
    table = _unicode_to_byte()
    if not isinstance(piece, str) or any(ch not in table for ch in piece):
        return None
    return [table[ch] for ch in piece]


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """Byte-level BPE writes printable bytes as themselves and the other bytes as code points from 256 up."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table
