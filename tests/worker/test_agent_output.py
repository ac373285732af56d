"""OutputSplitter: answer, reasoning and tool calls apart, whatever way the output is cut into deltas."""

from __future__ import annotations

import json

import pytest
from mlx_lm.tool_parsers import json_tools

from producer.models import GenerationRequest
from worker.requests.output_split import OutputSplitter, Piece, splitter_for

OUTPUT = (
    '<think>The user wants the weather.</think>Let me check. <tool_call>{"name": "get_weather", '
    '"arguments": {"city": "Paris"}}</tool_call><tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
)


def splitter(**overrides: object) -> OutputSplitter:
    fields: dict[str, object] = {
        "think": ("<think>", "</think>"),
        "tool_markers": (json_tools.tool_call_start, json_tools.tool_call_end),
        "tool_parser": json_tools.parse_tool_call,
        "tools": None,
        **overrides,
    }
    return OutputSplitter(**fields)  # type: ignore[arg-type]


def feed_in_pieces(split: OutputSplitter, text: str, size: int) -> list[Piece]:
    pieces = []
    for start in range(0, len(text), size):
        pieces += split.feed(text[start : start + size])
    return pieces + split.finish()


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_output_splits_the_same_whatever_the_deltas(size: int) -> None:
    split = splitter()
    pieces = feed_in_pieces(split, OUTPUT, size)
    assert split.reasoning == "The user wants the weather."
    assert split.text == "Let me check. "
    assert [(c.function.name, json.loads(c.function.arguments)) for c in split.tool_calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    assert "".join(p.text for p in pieces if p.kind == "text") == split.text
    assert "".join(p.text for p in pieces if p.kind == "reasoning") == split.reasoning
    assert [p.call for p in pieces if p.kind == "tool_call"] == split.tool_calls
    assert len({c.id for c in split.tool_calls}) == 2


def test_a_prompt_that_opens_thinking_starts_in_reasoning() -> None:
    split = splitter(starts_in="reasoning")
    feed_in_pieces(split, "hmm</think>Paris.", 4)
    assert (split.reasoning, split.text) == ("hmm", "Paris.")


def test_text_that_only_looks_like_a_marker_start_is_released() -> None:
    split = splitter()
    assert split.feed("a <to") == [Piece("text", "a ")]  # "<to" could open <tool_call>: held back
    assert split.feed("ol> <b") == [Piece("text", "<tool> <b")]  # "<b" opens no marker
    assert split.text == "a <tool> <b"


def test_a_tool_call_cut_by_max_tokens_stays_in_the_answer() -> None:
    split = splitter()
    feed_in_pieces(split, '<tool_call>{"name": "get_wea', 5)
    assert split.tool_calls == []
    assert split.text == '<tool_call>{"name": "get_wea</tool_call>'


def test_an_unterminated_but_complete_call_is_parsed() -> None:
    split = splitter()
    feed_in_pieces(split, '<tool_call>{"name": "f", "arguments": {"x": 1}}', 4)
    assert [c.function.name for c in split.tool_calls] == ["f"]


class ThinkingTokenizer:
    """What splitter_for reads of mlx-lm's TokenizerWrapper, for a template that marks thinking with
    tokens 1 (<think>) and 2 (</think>) and declares json_tools tool calling."""

    has_thinking = True
    think_start, think_end = "<think>", "</think>"
    has_tool_calling = True
    tool_call_start, tool_call_end = json_tools.tool_call_start, json_tools.tool_call_end
    tool_parser = staticmethod(json_tools.parse_tool_call)

    @staticmethod
    def rfind_think_start(tokens: list[int]) -> int:
        return max((i for i, t in enumerate(tokens) if t == 1), default=-1)

    @staticmethod
    def rfind_think_end(tokens: list[int]) -> int:
        return max((i for i, t in enumerate(tokens) if t == 2), default=-1)


TOOL = {"type": "function", "function": {"name": "f"}}


@pytest.mark.parametrize(
    ("fields", "prompt", "expected"),
    [
        ({}, [5, 6], ("text", True, False)),
        ({}, [5, 1, 6], ("reasoning", True, False)),  # the prompt left <think> open
        ({}, [1, 2, 6], ("text", True, False)),
        ({"tools": [TOOL]}, [5], ("text", True, True)),
        ({"tools": [TOOL], "tool_choice": "none"}, [5], ("text", True, False)),  # tools not offered
    ],
)
def test_splitter_for_reads_the_tokenizers_markers(
    fields: dict[str, object], prompt: list[int], expected: tuple[str, bool, bool]
) -> None:
    request = GenerationRequest(messages=[{"role": "user", "content": "hi"}], **fields)  # type: ignore[arg-type]
    split = splitter_for(ThinkingTokenizer(), request, prompt)
    assert split is not None
    assert (split.starts_in, split.think is not None, split.tool_markers is not None) == expected


def test_nothing_to_split_for_a_plain_tokenizer() -> None:
    request = GenerationRequest(messages=[{"role": "user", "content": "hi"}])
    assert splitter_for(object(), request, [1]) is None


def test_a_repeated_identical_call_is_dropped_and_marks_the_answer_complete() -> None:
    split = splitter()
    once = '<tool_call>{"name": "f", "arguments": {"x": 1, "y": 2}}</tool_call>\n'
    again = '<tool_call>{"name": "f", "arguments": {"y": 2, "x": 1}}</tool_call>'  # same call, other order
    feed_in_pieces(split, once, 3)
    assert not split.repeated_call
    pieces = feed_in_pieces(split, again, 3)
    assert split.repeated_call and len(split.tool_calls) == 1
    assert not [p for p in pieces if p.kind == "tool_call"]  # never published


def test_calls_with_other_arguments_are_all_kept() -> None:
    split = splitter()
    feed_in_pieces(
        split,
        '<tool_call>{"name": "f", "arguments": {"city": "Rome"}}</tool_call>'
        '<tool_call>{"name": "f", "arguments": {"city": "Oslo"}}</tool_call>',
        5,
    )
    assert not split.repeated_call and len(split.tool_calls) == 2
