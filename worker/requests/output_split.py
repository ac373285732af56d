"""Split what a model generates into the answer, its reasoning and its tool calls, as it streams.

The markers are the tokenizer's own (mlx-lm's TokenizerWrapper: `think_start`/`think_end` where the
template marks thinking, `tool_call_start`/`tool_call_end` and `tool_parser` where it declares tool
calling), so every template mlx-lm knows splits the way `mlx_lm.server` splits it. Text is released
as soon as it can no longer be the start of a marker; a tool call is parsed once its end marker
arrives (or the output ends).
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.core.params import SamplingParams
from producer.models import GenerationRequest, ToolCall, ToolCallFunction
from worker.jobs.payload import JobRejected
from worker.requests import tool_format
from worker.requests.tool_format import native_tool_calling, one_call, tool_dicts, tools_rendered

Part = Literal["text", "reasoning", "tool"]


@dataclass(frozen=True)
class Piece:
    """What one stretch of output turned out to be: answer text, reasoning text, or a parsed tool call."""

    kind: Literal["text", "reasoning", "tool_call"]
    text: str = ""
    call: ToolCall | None = None


@dataclass
class OutputSplitter:
    """One job's output, fed as it is generated. `starts_in` is "reasoning" when the prompt left a
    thinking block open (templates that start the answer inside `<think>`)."""

    think: tuple[str, str] | None
    tool_markers: tuple[str, str] | None
    tool_parser: Callable[[str, Any], Any] | None
    tools: list[dict[str, Any]] | None
    starts_in: Part = "text"
    text: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    #: The model wrote a call identical to one it had made in this answer: the answer is complete (small
    #: models under a forced call grammar repeat their call until max_tokens); the repeat is dropped.
    repeated_call: bool = False
    _part: Part = "text"
    _buffer: str = ""
    _tool_text: str = ""

    def __post_init__(self) -> None:
        self._part = self.starts_in

    def feed(self, delta: str) -> list[Piece]:
        self._buffer += delta
        pieces: list[Piece] = []
        while True:
            found = self._next_marker()
            if found is None:
                break
            index, marker, part = found
            pieces += self._emit(self._buffer[:index])
            pieces += self._switch(part)
            self._buffer = self._buffer[index + len(marker) :]
        keep = _partial_marker_length(self._buffer, [m for m, _ in self._markers()])
        pieces += self._emit(self._buffer[: len(self._buffer) - keep])
        self._buffer = self._buffer[len(self._buffer) - keep :]
        return pieces

    def finish(self) -> list[Piece]:
        """The output ended: release what was held back; a tool call without its end is parsed as is."""
        pieces = self._emit(self._buffer)
        self._buffer = ""
        if self._part == "tool":
            pieces += self._switch("text")
        return pieces

    def _markers(self) -> list[tuple[str, Part]]:
        if self._part == "reasoning":
            return [(self.think[1], "text")] if self.think else []
        if self._part == "tool":
            return [(self.tool_markers[1], "text")] if self.tool_markers else []
        markers: list[tuple[str, Part]] = []
        if self.think:
            markers.append((self.think[0], "reasoning"))
        if self.tool_markers:
            markers.append((self.tool_markers[0], "tool"))
        return markers

    def _next_marker(self) -> tuple[int, str, Part] | None:
        hits = [(self._buffer.find(m), m, part) for m, part in self._markers() if m in self._buffer]
        return min(hits, key=lambda hit: hit[0]) if hits else None

    def _emit(self, text: str) -> list[Piece]:
        if not text:
            return []
        if self._part == "tool":
            self._tool_text += text
            return []
        if self._part == "reasoning":
            self.reasoning += text
            return [Piece("reasoning", text)]
        self.text += text
        return [Piece("text", text)]

    def _switch(self, part: Part) -> list[Piece]:
        pieces: list[Piece] = []
        if self._part == "tool":
            pieces = self._parse(self._tool_text)
            self._tool_text = ""
        self._part = part
        return pieces

    def _parse(self, text: str) -> list[Piece]:
        """The tool calls in one marked stretch; text the parser refuses stays in the answer, marked."""
        assert self.tool_parser is not None and self.tool_markers is not None
        try:
            parsed = self.tool_parser(text, self.tools)
            calls = [_tool_call(item) for item in (parsed if isinstance(parsed, list) else [parsed])]
        except (ValueError, TypeError, KeyError, AttributeError):
            start, end = self.tool_markers
            unparsed = f"{start}{text}{end}"
            self.text += unparsed
            return [Piece("text", unparsed)]
        made = {_call_key(call) for call in self.tool_calls}
        fresh = [call for call in calls if _call_key(call) not in made]
        self.repeated_call = self.repeated_call or len(fresh) < len(calls)
        self.tool_calls += fresh
        return [Piece("tool_call", call=call) for call in fresh]


def _tool_call(parsed: Any) -> ToolCall:
    """mlx-lm's parsed call ({"name", "arguments": object}) in OpenAI's shape (arguments a JSON string)."""
    arguments = parsed["arguments"]
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    call_id = parsed.get("id") or f"call_{secrets.token_hex(12)}"
    return ToolCall(id=str(call_id), function=ToolCallFunction(name=str(parsed["name"]), arguments=text))


def _call_key(call: ToolCall) -> tuple[str, str]:
    """A call's name and arguments, the arguments as canonical JSON where they parse."""
    try:
        arguments = json.dumps(json.loads(call.function.arguments), sort_keys=True)
    except ValueError:
        arguments = call.function.arguments
    return call.function.name, arguments


def _partial_marker_length(text: str, markers: list[str]) -> int:
    """Length of the longest end of `text` that is the start of a marker (held back until it is clear)."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:n]):
                longest = n
                break
    return longest


def splitter_for(tokenizer: Any, request: GenerationRequest, prompt: list[int]) -> OutputSplitter | None:
    """The job's splitter, or None when nothing is to be split out (no tools offered, no thinking marks)."""
    think = None
    if getattr(tokenizer, "has_thinking", False) and request.messages is not None:
        think = (str(tokenizer.think_start), str(tokenizer.think_end))
    tools = None
    parser = None
    if tools_rendered(request):
        if native_tool_calling(tokenizer):
            tools, parser = (
                (str(tokenizer.tool_call_start), str(tokenizer.tool_call_end)),
                tokenizer.tool_parser,
            )
        else:
            tools, parser = tool_format.MARKERS, tool_format.parse_tool_call
    if think is None and tools is None:
        return None
    starts_in: Part = "text"
    if think is not None and tokenizer.rfind_think_start(prompt) > tokenizer.rfind_think_end(prompt):
        starts_in = "reasoning"
    return OutputSplitter(
        think=think,
        tool_markers=tools,
        tool_parser=parser,
        tools=tool_dicts(request) if tools else None,
        starts_in=starts_in,
    )


def refuse_grammar_in_reasoning(sampling: SamplingParams, output: OutputSplitter | None) -> None:
    """A grammar holds the output from its first token, so a prompt that leaves thinking open (the
    model would write its reasoning first) cannot take one: JobRejected, with the way out."""
    if sampling.grammar is not None and output is not None and output.starts_in == "reasoning":
        raise JobRejected(
            f"invalid request: the {sampling.grammar.what} holds the output from its first token, but this "
            'template starts the answer in thinking: send chat_template_kwargs {"enable_thinking": false}'
        )


def stop_after_one_call(
    sampling: SamplingParams, output: OutputSplitter | None, request: GenerationRequest
) -> SamplingParams:
    """With one call (one_call), the first tool call's end marker ends the row (a stop string: the
    call, unterminated in the text, is parsed when the output ends); other rows go on."""
    if output is None or output.tool_markers is None or not one_call(request):
        return sampling
    return dataclasses.replace(sampling, stop=(*sampling.stop, output.tool_markers[1]))
