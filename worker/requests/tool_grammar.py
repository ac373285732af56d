"""tool_choice "required" or a named function, enforced: a grammar of the model's own tool-call format.

The grammar admits only calls of the offered tools (or the named one), each with arguments that
validate against its tool's parameter schema, written between the markers the model's template uses,
so the parsed calls render back through the same template in the next turn. A named tool, or
parallel_tool_calls false, admits exactly one call (a small model under `call (GAP call)*` repeats the
named call until max_tokens); "required" one or more. The row ends when the grammar is complete.

Formats covered: mlx-lm's `json_tools` parser (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`:
Qwen 2.5 / 3, Hermes and the many templates that copied them). Another parser's format is refused with
its name, never left to chance.
"""

from __future__ import annotations

import json
from typing import Any

from engine.core.params import OutputGrammar, with_json_whitespace
from producer.models import GenerationRequest, NamedToolChoice, tool_choice_text
from worker.jobs.payload import JobRejected
from worker.requests.output_split import OutputSplitter
from worker.requests.tool_format import one_call

JSON_TOOL_MARKERS = ("<tool_call>", "</tool_call>")
#: Between a marker and the call's JSON, and between two calls: what templates write (a line break).
_GAP = r"/[ \t\n]{1,4}/"


def forced_tool_calls(
    tokenizer: Any, request: GenerationRequest, output: OutputSplitter | None
) -> OutputGrammar | None:
    """The grammar that makes the row call a tool, or None where the model decides (auto, none)."""
    choice = request.tool_choice
    if not (choice == "required" or isinstance(choice, NamedToolChoice)):
        return None
    if output is None or output.tool_markers is None or output.tool_parser is None:
        raise JobRejected("invalid request: this model's chat template declares no tool calling")
    named = tool_choice_text(choice)
    parser = getattr(output.tool_parser, "__module__", "").rsplit(".", 1)[-1]
    if output.tool_markers != JSON_TOOL_MARKERS or parser != "json_tools":
        raise JobRejected(
            f"invalid request: tool_choice {named} is enforced for templates whose tool "
            "calls are JSON between <tool_call> markers (mlx-lm's json_tools parser); this model's is "
            f"{parser or 'unknown'}: send tool_choice 'auto'"
        )
    if request.response_format is not None and request.response_format.type != "text":
        raise JobRejected(
            f"invalid request: tool_choice {named} makes the answer a tool call, "
            "so response_format cannot also hold it: leave one out"
        )
    offered = [tool.function for tool in request.tools or ()]
    if isinstance(choice, NamedToolChoice):
        offered = [function for function in offered if function.name == choice.function.name]
    calls = with_json_whitespace(
        {"anyOf": [_call_schema(function.name, function.parameters) for function in offered]}
    )
    start, end = (_marker(tokenizer, marker) for marker in JSON_TOOL_MARKERS)
    repeat = "" if one_call(request) else " (GAP call)*"
    lark = f"start: call{repeat}\ncall: {start} GAP? %json {json.dumps(calls)} GAP? {end}\nGAP: {_GAP}\n"
    return OutputGrammar("lark", lark, f"tool_choice {named}")


def _marker(tokenizer: Any, text: str) -> str:
    """A marker as Lark: its text, or the one token the template writes it as. llguidance counts added
    tokens such as `<tool_call>` as special: reachable only by their id, never by their text."""
    literal = json.dumps(text)
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    return f"({literal} | <[{ids[0]}]>)" if len(ids) == 1 else literal


def _call_schema(name: str, parameters: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": parameters or {"type": "object"}},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
