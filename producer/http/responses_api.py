"""OpenAI's Responses API (`/v1/responses`): bodies to GenerationRequest fields, input items to chat
messages, results and stream events back to Response objects and Responses stream events.

Only the shapes live here; what a stored response or a conversation is (an agent of its own, resumed
by `fork_from` or `continue`) is conversations.py's, the routes are conversations_routes.py's.

Input items map onto chat messages: `message` items (string content or `input_text` / `output_text`
parts; `developer` is `system`), `function_call` items the assistant message's tool_calls (consecutive
calls in one message), `function_call_output` items `tool` messages, `reasoning` items the next
assistant message's reasoning. Function tools come flat (`{"type": "function", "name", ...}`) and map
onto chat's nested shape; a `namespace` tool's functions are offered as `<namespace>.<name>` (OpenAI's
function names have no dot, so a dotted name is always a namespace's) and their calls go back as
`name` + `namespace`. Hosted tools (web search, file search, code interpreter, computer use...) are
left out of the prompt and named in `x-kvrq-ignored` (ignored.py), as are fields that change nothing
here; images and files are refused (a text model takes text).
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from producer.http.client_ids import codex_agent, valid_agent
from producer.http.errors import APIError, invalid
from producer.http.ignored import ignore
from producer.http.sse import named_event
from producer.models import GenerationResult, ToolCall
from producer.openai_shapes.bodies import PASSED_FIELDS as SAMPLER_FIELDS
from producer.wire.protocol import StreamEvent

#: Body fields kvrq maps.
FIELDS = frozenset(
    {
        "model",
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "text",
        "max_output_tokens",
        "temperature",
        "top_p",
        "stream",
        "stream_options",
        "store",
        "previous_response_id",
        "conversation",
        "metadata",
        "reasoning",
        "prompt_cache_key",
        "client_metadata",
    }
)
#: kvrq's own fields (the clients' extra_body), passed to the request as they are (as chat's are).
PASSED_FIELDS = SAMPLER_FIELDS | {"seed", "stop", "chat_template_kwargs"}
#: Fields that change nothing here, accepted and named in x-kvrq-ignored: billing, routing and cache
#: options (kvrq keeps each agent's whole KV anyway), `include` (what it names, such as encrypted
#: reasoning, does not exist for a local model: reasoning items come in plain text), server-side
#: compaction and truncation (the context is the model's; an answer is cut to what it leaves).
IGNORED_FIELDS = frozenset(
    {
        "user",
        "safety_identifier",
        "service_tier",
        "prompt_cache_retention",
        "prompt_cache_options",
        "include",
        "context_management",
        "truncation",
    }
)
#: Fields taken only at their neutral value: ignoring another would give a wrong answer.
NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "background": (False, None),
    "max_tool_calls": (None,),
    "prompt": (None,),
    "top_logprobs": (0, None),
}
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
TOOL_FIELDS = frozenset({"type", "name", "description", "parameters", "strict"})
#: Function tool fields the API defines that change nothing here (dropped, named).
IGNORED_TOOL_FIELDS = frozenset(
    {"defer_loading", "allowed_callers", "async", "output_schema", "cache_control"}
)
#: Between a namespace and its function's name in the name the model sees.
NAMESPACE_SEPARATOR = "."


@dataclass(frozen=True)
class Parsed:
    """A /v1/responses body taken apart.

    `fields`: GenerationRequest fields but the messages; `messages`: the input as chat messages
    (instructions not included); `items`: the input as the API lists it (each with an id); `calls`:
    the call ids of the input's function_call items; `answered`: call ids of function_call_output items
    whose call is not earlier in the input (the previous response or the conversation must hold it);
    `echo`: the request's settings as a Response object repeats them.
    """

    model: str | None
    fields: dict[str, Any]
    messages: list[dict[str, Any]]
    items: list[dict[str, Any]]
    calls: frozenset[str]
    answered: tuple[str, ...]
    instructions: str | None
    echo: dict[str, Any]
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    conversation: str | None = None
    cache_key: str | None = None


def new_id(prefix: str) -> str:
    """An unguessable id (192 random bits): ids are the only key to a stored response or conversation."""
    return f"{prefix}_{secrets.token_hex(24)}"


def parse(body: dict[str, Any]) -> Parsed:
    """A /v1/responses body; APIError 400 saying what is wrong."""
    known = FIELDS | PASSED_FIELDS | IGNORED_FIELDS
    for name, value in body.items():
        if name in NEUTRAL_VALUES:
            if value not in NEUTRAL_VALUES[name]:
                raise invalid(f"{name}={json.dumps(value)} is not supported by kvrq", param=name)
        elif name not in known:
            raise invalid(f"unknown field {name!r}", param=name)
        elif name in IGNORED_FIELDS and value is not None:
            ignore(name)
    if body.get("client_metadata") is not None:
        ignore("client_metadata")
    model = _optional(body, "model", str)
    stream = bool(_optional(body, "stream", bool))
    if body.get("stream_options") is not None and not stream:
        raise invalid("'stream_options' goes with 'stream': true", param="stream_options")
    store = _optional(body, "store", bool)
    previous = _optional(body, "previous_response_id", str)
    conversation = _conversation_id(body.get("conversation"))
    if previous and conversation:
        raise invalid("give 'previous_response_id' or 'conversation', not both", param="conversation")
    if conversation and store is False:
        raise invalid("'store': false cannot go with 'conversation' (a conversation keeps its items)")
    instructions = _optional(body, "instructions", str) or None
    items = input_items(body.get("input"))
    messages, calls, answered = chat_messages(items)
    tools = flat_tools(body.get("tools"))
    fields: dict[str, Any] = {
        "temperature": 1.0 if body.get("temperature") is None else body["temperature"],
        "top_p": 1.0 if body.get("top_p") is None else body["top_p"],
    }
    if body.get("max_output_tokens") is not None:
        fields["max_tokens"] = body["max_output_tokens"]
    fields.update({name: body[name] for name in sorted(PASSED_FIELDS) if body.get(name) is not None})
    if tools:
        fields["tools"] = [chat_tool(tool) for tool in tools]
    if body.get("tool_choice") is not None:
        choice, names = tool_choice(body["tool_choice"], [tool["name"] for tool in tools])
        fields["tool_choice"] = choice
        if names is not None:  # allowed_tools: the model sees only those
            fields["tools"] = [tool for tool in fields["tools"] if tool["function"]["name"] in names]
    if body.get("parallel_tool_calls") is not None:
        fields["parallel_tool_calls"] = _optional(body, "parallel_tool_calls", bool)
    text = _text_config(body.get("text"))
    if (response_format := _response_format(text.get("format"))) is not None:
        fields["response_format"] = response_format
    if (thinking := _thinking(body.get("reasoning"))) is not None:
        fields["chat_template_kwargs"] = {
            "enable_thinking": thinking,
            **fields.get("chat_template_kwargs", {}),
        }
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise invalid("'metadata' must be an object of strings", param="metadata")
    echo = {
        "instructions": instructions,
        "tools": tools,
        "tool_choice": body.get("tool_choice") or "auto",
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
        "text": text or {"format": {"type": "text"}},
        "temperature": fields["temperature"],
        "top_p": fields["top_p"],
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": metadata or {},
        "reasoning": body.get("reasoning") or {"effort": None, "summary": None},
        "previous_response_id": previous,
        "store": store is not False,
    }
    return Parsed(
        model=model,
        fields=fields,
        messages=messages,
        items=items,
        calls=calls,
        answered=answered,
        instructions=instructions,
        echo=echo,
        stream=stream,
        store=store is not False,
        previous_response_id=previous,
        conversation=conversation,
        cache_key=_cache_key(body),
    )


def _cache_key(body: dict[str, Any]) -> str | None:
    """The agent of a request kept by no record: `prompt_cache_key`, else the thread Codex names in
    client_metadata (client ids the agent-id rule refuses are hashed into valid ones)."""
    key = _optional(body, "prompt_cache_key", str)
    return valid_agent(key) if key else codex_agent(body.get("client_metadata"))


def _optional(body: dict[str, Any], name: str, kind: type) -> Any:
    value = body.get(name)
    if value is not None and not isinstance(value, kind):
        raise invalid(f"'{name}' must be a {'boolean' if kind is bool else 'string'}", param=name)
    return value


def _conversation_id(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value or None
    if isinstance(value, dict) and set(value) == {"id"} and isinstance(value["id"], str):
        return str(value["id"])
    raise invalid("'conversation' is a conversation id or {'id': ...}", param="conversation")


# ---- input items -----------------------------------------------------------------------------------


def input_items(value: Any, where: str = "input") -> list[dict[str, Any]]:
    """`input` (a string or a list of items) as a list of items in the API's own listed shape, each
    with an id (the client's where it gave one)."""
    if isinstance(value, str) and value:  # "" is as empty as []
        value = [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise invalid(f"'{where}' must be a non-empty string or list of items", param=where)
    return [_item(item, f"{where}[{index}]") for index, item in enumerate(value)]


def _item(item: Any, where: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise invalid(f"{where} must be an object (a message, function_call or function_call_output)")
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise invalid(f"{where}.role must be user, system, developer or assistant, not {role!r}")
        part = "output_text" if role == "assistant" else "input_text"
        out: dict[str, Any] = {
            "type": "message",
            "id": _item_id(item, "msg"),
            "role": role,
            "status": "completed",
            "content": [{"type": part, "text": _content_text(item.get("content"), where)}],
        }
        if role == "assistant":
            out["content"][0]["annotations"] = []
        return out
    if kind == "function_call":
        call_id, name, arguments = (_string(item, key, where) for key in ("call_id", "name", "arguments"))
        listed = {
            "type": "function_call",
            "id": _item_id(item, "fc"),
            "call_id": call_id,
            "name": name,
            "arguments": arguments,
            "status": "completed",
        }
        if isinstance(item.get("namespace"), str) and item["namespace"]:
            listed["namespace"] = item["namespace"]
        return listed
    if kind == "function_call_output":
        return {
            "type": "function_call_output",
            "id": _item_id(item, "fco"),
            "call_id": _string(item, "call_id", where),
            "output": _content_text(item.get("output"), f"{where}.output"),
            "status": "completed",
        }
    if kind == "reasoning":
        texts = [part.get("text", "") for part in item.get("content") or () if isinstance(part, dict)]
        summary = [part for part in item.get("summary") or () if isinstance(part, dict)]
        return {
            "type": "reasoning",
            "id": _item_id(item, "rs"),
            "summary": summary,
            "content": [{"type": "reasoning_text", "text": "".join(map(str, texts))}],
        }
    raise invalid(
        f"{where}: items of type {kind!r} are not supported (kvrq takes message, function_call, "
        "function_call_output and reasoning items)"
    )


def _item_id(item: dict[str, Any], prefix: str) -> str:
    given = item.get("id")
    return given if isinstance(given, str) and given else new_id(prefix)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (key != "arguments" and not value):
        raise invalid(f"{where}.{key} must be a{' non-empty' if key != 'arguments' else ''} string")
    return value


def _content_text(content: Any, where: str) -> str:
    """Text content: a string, or text parts joined (images, files and audio are refused)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind == "refusal" and isinstance(part.get("refusal"), str):
                texts.append(part["refusal"])
            elif kind in TEXT_PARTS and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                raise invalid(f"{where}: content part {kind!r} is not supported (kvrq takes text)")
        return "".join(texts)
    raise invalid(f"{where}.content must be a string or a list of text parts")


def chat_messages(
    items: list[dict[str, Any]],
) -> tuple[list[dict[str, Any]], frozenset[str], tuple[str, ...]]:
    """Items (input_items' shape) as chat messages, the call ids of their function_call items, and the
    call ids their function_call_output items answer without the call earlier among them."""
    messages: list[dict[str, Any]] = []
    calls: set[str] = set()
    answered: list[str] = []
    reasoning: list[str] = []
    for item in items:
        kind = item["type"]
        if kind == "reasoning":
            reasoning.append(item["content"][0]["text"])
            continue
        if kind == "function_call":
            calls.add(item["call_id"])
            name = flat_name(item.get("namespace"), item["name"])
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": name, "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if item["call_id"] not in calls:
                answered.append(item["call_id"])
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        else:
            role = ROLES[item["role"]]
            messages.append({"role": role, "content": item["content"][0]["text"]})
        if messages[-1]["role"] == "assistant" and reasoning:
            messages[-1]["reasoning"] = "".join(reasoning)
            reasoning = []
    return messages, frozenset(calls), tuple(answered)


# ---- tools, tool_choice, text.format, reasoning ------------------------------------------------------


def flat_tools(value: Any) -> list[dict[str, Any]]:
    """Function tools in the Responses API's flat shape, checked; a namespace's functions flattened
    (flat_name); hosted tools left out and named."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise invalid("'tools' must be a list", param="tools")
    tools = []
    for index, tool in enumerate(value):
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        if kind == "namespace":
            tools += _namespace_tools(tool, f"tools[{index}]")
        elif kind == "function":
            tools.append(_function_tool(tool, f"tools[{index}]"))
        elif isinstance(tool, dict) and isinstance(kind, str):
            ignore(f"tools.{kind}" if not isinstance(tool.get("name"), str) else f"tools.{tool['name']}")
        else:
            raise invalid(f"tools[{index}] must be a tool object with a 'type'", param="tools")
    return tools


def _function_tool(tool: dict[str, Any], where: str, namespace: str | None = None) -> dict[str, Any]:
    if unknown := sorted(set(tool) - TOOL_FIELDS - IGNORED_TOOL_FIELDS):
        raise invalid(f"{where} has unsupported field(s) {', '.join(unknown)}", param="tools")
    if not isinstance(tool.get("name"), str):
        raise invalid(f"{where}.name must be a string", param="tools")
    out = {key: tool[key] for key in sorted(TOOL_FIELDS) if tool.get(key) is not None}
    out["name"] = flat_name(namespace, tool["name"])
    return out


def _namespace_tools(tool: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """A namespace's function tools, named `<namespace>.<name>`; its other tools left out and named."""
    name, inner = tool.get("name"), tool.get("tools")
    if not isinstance(name, str) or not name or not isinstance(inner, list):
        raise invalid(f"{where}: a namespace tool has a 'name' and a list of 'tools'", param="tools")
    out = []
    for index, function in enumerate(inner):
        if isinstance(function, dict) and function.get("type") == "function":
            out.append(_function_tool(function, f"{where}.tools[{index}]", name))
        else:
            ignore(f"tools.{name}.{function.get('name') if isinstance(function, dict) else index}")
    return out


def flat_name(namespace: str | None, name: str) -> str:
    """The name the model sees for a function of `namespace` (None: a plain function)."""
    return name if not namespace else f"{namespace}{NAMESPACE_SEPARATOR}{name}"


def split_name(flat: str) -> tuple[str | None, str]:
    """(namespace, name) of a name the model called (flat_name's inverse)."""
    namespace, dot, name = flat.rpartition(NAMESPACE_SEPARATOR)
    return (namespace, name) if dot and namespace and name else (None, flat)


def chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A flat function tool in chat's nested shape (what GenerationRequest takes)."""
    return {"type": "function", "function": {key: value for key, value in tool.items() if key != "type"}}


def tool_choice(choice: Any, offered: list[str]) -> tuple[Any, list[str] | None]:
    """`tool_choice` as GenerationRequest's, and the tools it allows (None: all offered). `allowed_tools`
    narrows the tools the model sees to those it lists, `mode` the choice among them (the prompt then
    holds only those tools)."""
    if choice in ("auto", "none", "required"):
        return choice, None
    if not isinstance(choice, dict):
        raise invalid("'tool_choice' is auto, none, required or an object", param="tool_choice")
    kind = choice.get("type")
    if kind == "function":
        name = choice.get("name")
        _offered(name, offered)
        return {"type": "function", "function": {"name": name}}, None
    if kind == "allowed_tools":
        mode, tools = choice.get("mode"), choice.get("tools")
        if mode not in ("auto", "required") or not isinstance(tools, list) or not tools:
            raise invalid(
                "tool_choice allowed_tools takes mode (auto or required) and a non-empty list of tools",
                param="tool_choice",
            )
        names = []
        for tool in tools:
            if not isinstance(tool, dict) or tool.get("type") != "function":
                raise invalid("tool_choice allowed_tools lists function tools", param="tool_choice")
            names.append(_offered(tool.get("name"), offered))
        return mode, names
    raise invalid(
        f"tool_choice of type {kind!r} is not supported (kvrq takes function and allowed_tools)",
        param="tool_choice",
    )


def _offered(name: Any, offered: list[str]) -> str:
    if not isinstance(name, str) or name not in offered:
        raise invalid(
            f"tool_choice names the tool {name!r}, which is not among the tools offered "
            f"({', '.join(offered) or 'none'})",
            param="tool_choice",
        )
    return name


def _text_config(text: Any) -> dict[str, Any]:
    if text is None:
        return {}
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise invalid("'text' takes 'format' (and 'verbosity')", param="text")
    return {key: value for key, value in text.items() if value is not None}


def _response_format(fmt: Any) -> dict[str, Any] | None:
    """text.format as chat's response_format (json_schema's fields sit flat in the Responses API)."""
    if fmt is None or fmt == {"type": "text"}:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = {key: value for key, value in fmt.items() if key != "type" and value is not None}
        if unknown := sorted(set(spec) - {"name", "schema", "description", "strict"}):
            raise invalid(f"text.format has unsupported field(s) {', '.join(unknown)}", param="text")
        return {"type": "json_schema", "json_schema": spec}
    raise invalid("text.format is text, json_object or json_schema", param="text")


def _thinking(reasoning: Any) -> bool | None:
    """reasoning.effort as the template's enable_thinking: `none` off, another effort on, none given:
    the template's default."""
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise invalid("'reasoning' must be an object", param="reasoning")
    for key in ("effort", "summary"):  # echoed back in the Response: a word, as the API has them
        word = reasoning.get(key)
        if word is not None and (not isinstance(word, str) or not word.isascii()):
            raise invalid(
                f"'reasoning.{key}' must be one of the API's words (e.g. 'auto')", param="reasoning"
            )
    if reasoning.get("summary") is not None:
        ignore("reasoning.summary")  # a local model writes no summary: reasoning items carry its text
    effort = reasoning.get("effort")
    return None if effort is None else effort != "none"


# ---- Response objects --------------------------------------------------------------------------------


def response_object(
    response_id: str,
    model: str,
    echo: dict[str, Any],
    *,
    created_at: int,
    output: list[dict[str, Any]],
    status: str,
    result: GenerationResult | None = None,
    conversation: str | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "model": model,
        "output": output,
        **echo,
        "truncation": "disabled",
        "usage": None if result is None else usage(result),
        "conversation": None if conversation is None else {"id": conversation},
    }
    if result is not None:
        body["completed_at"] = int(time.time())
        body["kvrq"] = {
            "job_id": result.job_id,
            "agent_id": result.agent_id,
            "usage": result.usage.model_dump(),
            "timings": result.timings.model_dump(),
            "worker": result.worker,
        }
    return body


def usage(result: GenerationResult) -> dict[str, Any]:
    """OpenAI's usage: `cached_tokens` are the prompt tokens resumed from the agent's KV."""
    figures = result.usage
    return {
        "input_tokens": figures.prompt_tokens,
        "input_tokens_details": {"cached_tokens": figures.reused_tokens, "cache_write_tokens": 0},
        "output_tokens": figures.generated_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": figures.prompt_tokens + figures.generated_tokens,
    }


def status_of(result: GenerationResult) -> str:
    return "incomplete" if result.finish_reason == "length" else "completed"


def output_items(result: GenerationResult) -> list[dict[str, Any]]:
    """A result's output: its reasoning, its answer's text (when it has any), its function calls."""
    status = status_of(result)
    out = []
    if result.reasoning:
        out.append(reasoning_item(new_id("rs"), result.reasoning, status))
    if result.text.strip():
        out.append(message_item(new_id("msg"), result.text, status))
    out += [call_item(new_id("fc"), call.model_dump(), "completed") for call in result.tool_calls or ()]
    return out


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_text_part(text)]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call: dict[str, Any], status: str) -> dict[str, Any]:
    """A function_call output item from a call in chat's shape ({"id", "function": {...}})."""
    ToolCall.model_validate(call)
    function = call["function"]
    namespace, name = split_name(function["name"])
    item = {
        "type": "function_call",
        "id": item_id,
        "call_id": call["id"],
        "name": name,
        "arguments": function["arguments"] if status == "completed" else "",
        "status": status,
    }
    if namespace is not None:
        item["namespace"] = namespace
    return item


def call_ids(output: list[dict[str, Any]]) -> set[str]:
    return {item["call_id"] for item in output if item["type"] == "function_call"}


# ---- streams -----------------------------------------------------------------------------------------


@dataclass
class ResponseStream:
    """A job's stream events as the Responses API streams: response.created and .in_progress, then per
    output item output_item.added, its content (content_part.added, output_text / reasoning_text
    deltas and .done, content_part.done; a call's function_call_arguments.delta and .done), and
    output_item.done; last response.completed (or .incomplete) with the whole Response, which
    `finish` builds from the items streamed and the job's result. Every event has a sequence_number.

    Text that is only whitespace waits for more before it opens a message (a call's result often
    follows a newline), so the streamed output equals the one a plain request answers."""

    response_id: str
    model: str
    echo: dict[str, Any]
    conversation: str | None = None
    flavor: Any = "openai"
    created_at: int = field(default_factory=lambda: int(time.time()))
    sequence: int = 0
    output: list[dict[str, Any]] = field(default_factory=list)
    current: dict[str, Any] | None = None  # the item open now (message or reasoning)
    text: str = ""  # the open item's text so far
    waiting: str = ""  # whitespace not yet sent
    final: dict[str, Any] | None = None

    def head(self) -> list[bytes]:
        snapshot = self.snapshot("in_progress")
        return [
            self.emit("response.created", response=snapshot),
            self.emit("response.in_progress", response=snapshot),
        ]

    def snapshot(self, status: str, result: GenerationResult | None = None) -> dict[str, Any]:
        return response_object(
            self.response_id,
            self.model,
            self.echo,
            created_at=self.created_at,
            output=list(self.output),
            status=status,
            result=result,
            conversation=self.conversation,
        )

    def emit(self, kind: str, **payload: Any) -> bytes:
        event = named_event({"type": kind, **payload, "sequence_number": self.sequence})
        self.sequence += 1
        return event

    def event(self, event: StreamEvent) -> list[bytes]:
        if event.kind == "delta" and event.text:
            return self.delta("message", event.text)
        if event.kind == "reasoning" and event.text:
            return self.delta("reasoning", event.text)
        if event.kind == "tool_call" and event.data is not None:
            return [*self.close(), *self.call(event.data)]
        if event.kind == "end":
            self.waiting = ""
            return self.close("incomplete" if event.finish_reason == "length" else "completed")
        return []

    def delta(self, kind: str, text: str) -> list[bytes]:
        out: list[bytes] = []
        if self.current is None or self.current["type"] != kind:
            if kind == "message" and not (self.waiting + text).strip():
                self.waiting += text
                return []
            out += self.close()
            out += self.open(kind)
        if kind == "message":
            text, self.waiting = self.waiting + text, ""
        self.text += text
        where = {"item_id": self.current_id, "output_index": len(self.output), "content_index": 0}
        if kind == "message":
            return [*out, self.emit("response.output_text.delta", **where, delta=text, logprobs=[])]
        return [*out, self.emit("response.reasoning_text.delta", **where, delta=text)]

    @property
    def current_id(self) -> str:
        assert self.current is not None
        return str(self.current["id"])

    def open(self, kind: str) -> list[bytes]:
        if kind == "message":
            self.current, part = message_item(new_id("msg"), None, "in_progress"), _text_part("")
        else:
            self.current = reasoning_item(new_id("rs"), "", "in_progress")
            part = {"type": "reasoning_text", "text": ""}
        index = len(self.output)
        return [
            self.emit("response.output_item.added", output_index=index, item=self.current),
            self.emit(
                "response.content_part.added",
                item_id=self.current_id,
                output_index=index,
                content_index=0,
                part=part,
            ),
        ]

    def close(self, status: str = "completed") -> list[bytes]:
        if self.current is None:
            return []
        where = {"item_id": self.current_id, "output_index": len(self.output), "content_index": 0}
        if self.current["type"] == "message":
            item, part = message_item(self.current_id, self.text, status), _text_part(self.text)
            done = self.emit("response.output_text.done", **where, text=self.text, logprobs=[])
        else:
            item = reasoning_item(self.current_id, self.text, status)
            part = {"type": "reasoning_text", "text": self.text}
            done = self.emit("response.reasoning_text.done", **where, text=self.text)
        out = [
            done,
            self.emit("response.content_part.done", **where, part=part),
            self.emit("response.output_item.done", output_index=where["output_index"], item=item),
        ]
        self.output.append(item)
        self.current, self.text = None, ""
        return out

    def call(self, data: dict[str, Any]) -> list[bytes]:
        item_id, index = new_id("fc"), len(self.output)
        done = call_item(item_id, data, "completed")
        where = {"item_id": item_id, "output_index": index}
        self.output.append(done)
        return [
            self.emit(
                "response.output_item.added", output_index=index, item=call_item(item_id, data, "in_progress")
            ),
            self.emit("response.function_call_arguments.delta", **where, delta=done["arguments"]),
            self.emit(
                "response.function_call_arguments.done",
                **where,
                arguments=done["arguments"],
                name=done["name"],
            ),
            self.emit("response.output_item.done", output_index=index, item=done),
        ]

    def finish(self, result: GenerationResult) -> dict[str, Any]:
        """The whole Response once the job has ended: the items streamed, the result's usage."""
        self.final = self.snapshot(status_of(result), result)
        return self.final

    def tail(self, result: GenerationResult | None) -> list[bytes]:
        if result is None:  # canceled: the client has left; nothing is stored
            failed = self.snapshot("cancelled")
            return [self.emit("response.failed", response=failed)]
        final = self.final or self.finish(result)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return [self.emit(kind, response=final)]


def not_found(what: str, ident: str, *, status: int, param: str | None = None) -> APIError:
    """A response or conversation that does not exist, or is another key's (the same answer: an id
    tells nothing about what others stored)."""
    return APIError(status, f"{what} with id {ident!r} not found", code="not_found", param=param)
