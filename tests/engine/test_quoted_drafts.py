"""Drafts for a tool call quoting a file the agent was shown: the file is in the context as plain text
and comes back inside a JSON string, escaped, in other tokens. The prompt lookup reads the context as
quoted too (engine/batch/drafters.py: QuotedContext). Real SmolLM2 tokenizer (byte-level BPE)."""

from __future__ import annotations

import json
from typing import Any

import mlx.core as mx
import pytest

from benchmarks.bench_spec import source_file
from engine.batch.drafters import NgramIndex, PromptLookup
from engine.batch.engine import BlockPoolBatchEngine
from engine.models.gguf_smollm2 import gguf_path
from engine.models.gguf_tokenizer import tokenizer_from_gguf_metadata
from tests.engine.tiny import tiny_model

VOCAB = 49152  # SmolLM2's
#: The file as the tool call quotes it, in a JSON string.
QUOTED = json.dumps(source_file(3), ensure_ascii=False)[1:-1]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    loaded: Any = mx.load(str(gguf_path()), return_metadata=True)
    return tokenizer_from_gguf_metadata(loaded[1])


class CountingTokenizer:
    """The tokenizer, counting its encodes (a quoted view is one)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.encodes = tokenizer, 0

    def decode(self, tokens: list[int]) -> str:
        return str(self.tokenizer.decode(tokens))

    def encode(self, text: str) -> list[int]:
        self.encodes += 1
        return list(self.tokenizer.encode(text))


def context_of(tokenizer: Any, written: int) -> list[int]:
    """A prompt showing the file, then an answer that has written the quoted file's first `written`
    tokens (as the model writes them: the escaped text's own tokens)."""
    prompt = f"This is src/mod3.py:\n\n{source_file(3)}\nCopy it to backup/mod3.py with write_file.\n"
    answer = '{"name": "write_file", "arguments": {"path": "backup/mod3.py", "content": "'
    quoted = list(tokenizer.encode(QUOTED))
    return list(tokenizer.encode(prompt)) + list(tokenizer.encode(answer)) + quoted[:written]


@pytest.mark.parametrize("written", [12, 40, 90])
def test_a_json_string_quoting_the_context_is_drafted_from_the_context_as_quoted(
    tokenizer: Any, written: int
) -> None:
    index = NgramIndex(tokenizer)
    for so_far in range(1, written):  # the row's steps so far
        index.draft(context_of(tokenizer, so_far), 12)
    context = context_of(tokenizer, written)
    quoted = list(tokenizer.encode(QUOTED))
    assert index.draft(context, 12) == quoted[written : written + 12]
    plain = NgramIndex().draft(context, 12)
    assert plain != quoted[written : written + 12], "the plain lookup drafts it: the test tests nothing"


def test_a_row_writing_plain_text_never_builds_a_quoted_view(tokenizer: Any) -> None:
    counting = CountingTokenizer(tokenizer)
    index = NgramIndex(counting)
    context = context_of(tokenizer, 0)[:-20]  # ends in the prompt: plain text, no escapes
    for grown in range(10):
        index.draft(context + list(tokenizer.encode(" and the file is copied" * grown)), 8)
    assert counting.encodes == 0


def test_the_quoted_view_is_built_once_a_row(tokenizer: Any) -> None:
    counting = CountingTokenizer(tokenizer)
    index = NgramIndex(counting)
    for written in (12, 24, 36, 48):
        index.draft(context_of(tokenizer, written), 8)
    assert counting.encodes == 1


def test_the_engines_rows_look_up_the_quoted_context(tokenizer: Any) -> None:
    engine = BlockPoolBatchEngine(
        tiny_model("llama", vocab_size=VOCAB), tokenizer, model_name="tiny", pool_blocks=8
    )
    try:
        assert isinstance(engine.drafter, PromptLookup) and engine.drafter.tokenizer is tokenizer
        row = engine.drafter.for_row()
        assert isinstance(row, NgramIndex)
        assert row.draft(context_of(tokenizer, 12), 4) == list(tokenizer.encode(QUOTED))[12:16]
    finally:
        engine.close()
