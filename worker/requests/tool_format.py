"""The request's tools: whether they reach the template, and tool calling for chat templates that
declare none (the builtin SmolLM2's among them).

Such a template cannot render `tools`, an assistant's `tool_calls` or a `tool` message, so kvrq writes them
into the conversation itself, in the Hermes format many models were trained on: the tools described in the
system message, each call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in the assistant's
text, each result as a user turn inside `<tool_response>`. The calls are parsed with mlx-lm's json_tools
parser, and `tool_choice` "required" or a named function is enforced by the same grammar as for templates
that use that format natively (worker/requests/tool_grammar.py). A call written back renders as the model
wrote it, so the agent's KV resumes across the round trip.
"""

from __future__ import annotations

import json
from typing import Any

from mlx_lm.tool_parsers import json_tools

from producer.models import GenerationRequest, NamedToolChoice

MARKERS = (json_tools.tool_call_start, json_tools.tool_call_end)
parse_tool_call = json_tools.parse_tool_call

_INSTRUCTIONS = (
    "You may call functions to help with the user's request. The functions are described in "
    "<tools></tools>:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with nothing but:\n"
    '<tool_call>\n{{"name": <function name>, "arguments": <arguments as a JSON object>}}\n</tool_call>'
)


def native_tool_calling(tokenizer: Any) -> bool:
    """Whether the model's own template renders tools (mlx-lm found its tool-call format)."""
    return bool(getattr(tokenizer, "has_tool_calling", False))


def written_into_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """Template messages with the tools, the calls and their results written as plain text."""
    out: list[dict[str, Any]] = []
    for message in messages:
        if message["role"] == "tool":
            out.append(
                {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
            )
        elif message.get("tool_calls"):
            calls = "\n".join(_call_text(call["function"]) for call in message["tool_calls"])
            text = f"{message['content']}\n{calls}" if message.get("content") else calls
            out.append({"role": message["role"], "content": text})
        else:
            out.append({key: value for key, value in message.items() if key != "tool_calls"})
    if tools:
        described = _INSTRUCTIONS.format(tools="\n".join(json.dumps(tool) for tool in tools))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{described}"}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out


def _call_text(function: dict[str, Any]) -> str:
    arguments = function["arguments"]
    if isinstance(arguments, str):  # not JSON: kept as the model wrote it
        body = f'{{"name": {json.dumps(function["name"])}, "arguments": {arguments}}}'
    else:
        body = json.dumps({"name": function["name"], "arguments": arguments})
    return f"{MARKERS[0]}\n{body}\n{MARKERS[1]}"


def tools_rendered(request: GenerationRequest) -> bool:
    """Whether the request's tools go to the template (tool_choice "none": the model is not offered them)."""
    return bool(request.tools) and request.tool_choice != "none"


def tool_dicts(request: GenerationRequest) -> list[dict[str, Any]]:
    return [tool.model_dump(mode="json", exclude_none=True) for tool in request.tools or ()]


def one_call(request: GenerationRequest) -> bool:
    """Whether the answer holds at most one tool call: parallel_tool_calls false, or a named tool."""
    return request.parallel_tool_calls is False or isinstance(request.tool_choice, NamedToolChoice)
