"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`): bodies to GenerationRequest
fields, results and stream events back to Anthropic's shapes.

Content blocks map onto chat messages: `text` blocks are the content, an assistant's `tool_use` blocks
its tool_calls (input as JSON arguments), a user's `tool_result` blocks `tool` messages (ahead of the
user's text), an assistant's `thinking` blocks its reasoning. Images, documents and server tools are
refused (a text model takes text). The agent is the X-Kvrq-Agent header, else the one Claude Code
names (client_ids.claude_code_agent: a subagent's header, metadata.user_id, the session header).

Every field the API defines is accepted: what kvrq cannot act on is named in `x-kvrq-ignored`
(ignored.py), hosted (server) tools are left out of the prompt and named the same way. Claude Code's
`x-anthropic-billing-header` system block is client bookkeeping (its `cch=` changes every request):
it is left out of the prompt, so it never breaks the agent's reuse. A `role: "system"` message in the
middle of `messages` is folded into the next user turn, ahead of its text (every template renders a
user turn; not all take a system message after the first); with no user turn next (the last
messages, or an assistant's next) they are a user turn of their own. Either way a message renders the
same whatever later turns append, so each turn resumes the whole of the one before.
`context_management` edits are applied before rendering (context_edits.py).

Usage follows Anthropic's meaning: `input_tokens` are the prompt tokens run through the model,
`cache_read_input_tokens` those resumed from the agent's cache (their sum is the prompt).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from producer.http.client_ids import claude_code_agent
from producer.http.context_edits import apply_edits
from producer.http.errors import Flavor, invalid
from producer.http.ignored import ignore
from producer.http.memory_fields import client_agent, memory_fields
from producer.http.sse import named_event
from producer.models import GenerationResult, Usage
from producer.wire.protocol import StreamEvent

#: Body fields of /v1/messages kvrq maps (temperature, top_p and top_k as the API had them before 2026).
FIELDS = frozenset(
    {
        "model",
        "messages",
        "max_tokens",
        "system",
        "temperature",
        "top_p",
        "top_k",
        "stop_sequences",
        "stream",
        "tools",
        "tool_choice",
        "metadata",
        "thinking",
        "output_config",
        "output_format",
        "context_management",
    }
)
#: Fields the API defines that change nothing here, accepted and named in x-kvrq-ignored: cache hints
#: (kvrq caches each agent whole), routing and billing options, Anthropic-hosted containers and MCP
#: servers (kvrq runs neither: their tools are not offered).
IGNORED_FIELDS = frozenset(
    {
        "cache_control",
        "service_tier",
        "inference_geo",
        "speed",
        "diagnostics",
        "workspace_id",
        "user_profile_id",
        "container",
        "mcp_servers",
    }
)
#: count_tokens takes the same body without the generation settings.
COUNT_FIELDS = frozenset(
    {
        "model",
        "messages",
        "system",
        "tools",
        "tool_choice",
        "thinking",
        "output_config",
        "output_format",
        "context_management",
        "metadata",
    }
)
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "canceled": "end_turn"}
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
#: Claude Code's first system block: client bookkeeping, never part of the prompt.
BILLING_HEADER = "x-anthropic-billing-header:"
#: Client tools: Anthropic's own types are server tools (web search, code execution) or tools whose
#: schema lives with Anthropic (computer use, bash, text editor): the model here could not call them.
CLIENT_TOOL_TYPES = (None, "custom")


@dataclass(frozen=True)
class Parsed:
    model: str | None
    fields: dict[str, Any]
    stream: bool = False


def parse(
    body: dict[str, Any],
    *,
    agent: str | None = None,
    count: bool = False,
    headers: Mapping[str, str] | None = None,
) -> Parsed:
    """A Messages body (`count`: a count_tokens body) as GenerationRequest fields; APIError 400 if bad.
    `agent`: the X-Kvrq-Agent header; `headers`: the request's, for the ids Claude Code sends there."""
    body = dict(body)
    memory = memory_fields(body)
    allowed = COUNT_FIELDS if count else FIELDS
    if unknown := sorted(set(body) - allowed - IGNORED_FIELDS):
        raise invalid(f"unknown field(s) {', '.join(unknown)} (kvrq takes: {', '.join(sorted(allowed))})")
    for name in sorted(IGNORED_FIELDS & set(body)):
        ignore(name)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("'model' must be a string")
    if not count and body.get("max_tokens") is None:
        raise invalid("'max_tokens' is required")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise invalid("'stream' must be true or false")
    system = _system(body.get("system"))
    messages = body.get("messages")
    if body.get("context_management") is not None and isinstance(messages, list):
        rest = len(json.dumps([system, body.get("tools")], ensure_ascii=False))
        messages, _applied = apply_edits(body["context_management"], messages, rest)
    fields: dict[str, Any] = {"messages": _messages(system, messages), **memory}
    if not count:
        fields.update(_sampling(body))
    tools = _tools(body.get("tools")) if body.get("tools") else []
    if tools:
        fields["tools"] = tools
    if body.get("tool_choice") is not None:
        fields.update(_tool_choice(body["tool_choice"], [tool["function"]["name"] for tool in tools]))
    if (config := body.get("output_config")) is not None:
        fields.update(_output_config(config))
    if body.get("output_format") is not None:
        fields.update(_output_config({"format": body["output_format"]}))
    if (thinking := body.get("thinking")) is not None:
        fields["chat_template_kwargs"] = {"enable_thinking": _thinking_enabled(thinking)}
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise invalid("'metadata' must be an object")
    if agent:
        fields["agent_id"] = client_agent(agent, "the agent (X-Kvrq-Agent)")
    elif named := claude_code_agent((metadata or {}).get("user_id"), headers or {}):
        fields["agent_id"] = client_agent(named, "the agent (metadata.user_id)")
    return Parsed(model, fields, bool(stream))


def _system(system: Any) -> Any:
    """The system prompt without Claude Code's billing-header block (named as ignored)."""
    if not isinstance(system, list):
        return system
    kept = []
    for index, block in enumerate(system):
        if isinstance(block, dict) and str(block.get("text", "")).startswith(BILLING_HEADER):
            ignore(f"system[{index}]")
        else:
            kept.append(block)
    return kept


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    """Anthropic's defaults: temperature 1, top_p 1, no top_k."""
    out: dict[str, Any] = {"max_tokens": body["max_tokens"], "temperature": 1.0}
    for name in ("temperature", "top_p", "top_k"):
        if body.get(name) is not None:
            out[name] = body[name]
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list):
            raise invalid("'stop_sequences' must be a list of strings")
        out["stop"] = stops
    return out


def _messages(system: Any, messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list")
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": _text(system, "system")})
    pending: list[str] = []  # mid-conversation system messages, for the next user turn
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant", "system"):
            raise invalid(f"messages[{index}] must be an object with role 'user', 'assistant' or 'system'")
        if unknown := sorted(set(message) - {"role", "content"}):
            raise invalid(f"messages[{index}] has unknown field(s) {', '.join(unknown)}")
        content = message.get("content")
        if message["role"] == "system":
            pending.append(_text(content, f"messages[{index}].content"))
            continue
        if message["role"] == "user" and pending and isinstance(content, str | list):
            blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
            content = [{"type": "text", "text": text + "\n\n"} for text in pending] + blocks
            pending = []
        elif message["role"] == "assistant" and pending:  # as they were rendered when they came last
            out.append({"role": "user", "content": "\n\n".join(pending)})
            pending = []
        if isinstance(content, str):
            out.append({"role": message["role"], "content": content})
        elif isinstance(content, list):
            out += _blocks(message["role"], content, f"messages[{index}]")
        else:
            raise invalid(f"messages[{index}].content must be a string or a list of content blocks")
    if pending:  # system messages last: a user turn of their own
        out.append({"role": "user", "content": "\n\n".join(pending)})
    return out


def _blocks(role: str, blocks: list[Any], where: str) -> list[dict[str, Any]]:
    """One message's content blocks as chat messages: tool results first (user), then the message."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    thinking: list[str] = []
    for index, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content[{index}]"
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            calls.append(_call(block, at))
        elif kind == "tool_result" and role == "user":
            results.append(_result(block, at))
        elif kind == "thinking" and role == "assistant":
            thinking.append(str(block.get("thinking", "")))
        elif kind == "redacted_thinking":
            continue
        else:
            raise invalid(
                f"{at}: a {kind!r} block is not supported in a {role} message "
                "(kvrq takes text; tool_use from the assistant, tool_result from the user)"
            )
    if role == "user":
        return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning"] = "".join(thinking)
    return [message]


def _call(block: dict[str, Any], at: str) -> dict[str, Any]:
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
        raise invalid(f"{at}: a tool_use block needs 'id' and 'name'")
    arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
    return {
        "id": block["id"],
        "type": "function",
        "function": {"name": block["name"], "arguments": arguments},
    }


def _result(block: dict[str, Any], at: str) -> dict[str, Any]:
    if not isinstance(block.get("tool_use_id"), str):
        raise invalid(f"{at}: a tool_result block needs 'tool_use_id'")
    content = block.get("content")
    text = "" if content is None else _text(content, f"{at}.content")
    if block.get("is_error"):
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": text}


def _text(content: Any, where: str) -> str:
    """A string, or a list of text blocks joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str) for b in content
    ):
        return "".join(b["text"] for b in content)
    raise invalid(f"'{where}' must be a string or a list of text blocks")


def _tools(tools: Any) -> list[dict[str, Any]]:
    """Client tools in chat's shape; Anthropic's own tool types are left out and named."""
    if not isinstance(tools, list):
        raise invalid("'tools' must be a list")
    out = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict) or "name" not in tool:
            raise invalid(f"tools[{index}]: a tool is {{name, description, input_schema}}")
        if tool.get("type") not in CLIENT_TOOL_TYPES:
            ignore(f"tools.{tool['name']}")
            continue
        function = {"name": tool["name"], "parameters": tool.get("input_schema")}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any, offered: list[str]) -> dict[str, Any]:
    if not isinstance(choice, dict) or choice.get("type") not in (*TOOL_CHOICES, "tool"):
        raise invalid("'tool_choice' is {type: auto | any | tool | none}")
    out: dict[str, Any] = {}
    if choice["type"] == "tool":
        if choice.get("name") not in offered:
            raise invalid(
                f"tool_choice names {choice.get('name')!r}, which is not among the client tools kvrq "
                f"offers the model ({', '.join(offered) or 'none'}): name one of those"
            )
        out["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    else:
        out["tool_choice"] = TOOL_CHOICES[choice["type"]]
    if choice.get("disable_parallel_tool_use"):
        out["parallel_tool_calls"] = False
    return out


def _output_config(config: Any) -> dict[str, Any]:
    """`format` (a JSON schema the answer must follow) becomes response_format; `effort` changes nothing."""
    if not isinstance(config, dict) or set(config) - {"format", "effort"}:
        raise invalid("'output_config' takes 'format' ({type: json_schema, schema}) and 'effort'")
    if config.get("effort") is not None:
        ignore("output_config.effort")
    form = config.get("format")
    if form is None:
        return {}
    if (
        not isinstance(form, dict)
        or form.get("type") != "json_schema"
        or not isinstance(form.get("schema"), dict)
    ):
        raise invalid("'output_config.format' is {type: json_schema, schema: {...}}")
    return {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": form["schema"]},
        }
    }


def _thinking_enabled(thinking: Any) -> bool:
    """`enabled` and `adaptive` turn the template's thinking on (a model without any ignores it); a
    token budget is not enforced here (named as ignored)."""
    if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled", "adaptive"):
        raise invalid("'thinking' is {type: enabled | disabled | adaptive}")
    if thinking.get("budget_tokens") is not None:
        ignore("thinking.budget_tokens")
    return bool(thinking["type"] != "disabled")


def usage(result: GenerationResult | None) -> dict[str, int]:
    return usage_of(None if result is None else result.usage)


def usage_of(used: Usage | None) -> dict[str, int]:
    """Anthropic's usage of a job's usage (None: a job without one, canceled)."""
    if used is None:
        return {"input_tokens": 0, "output_tokens": 0, "cache_read_input_tokens": 0}
    return {
        "input_tokens": used.prompt_tokens - used.reused_tokens,
        "output_tokens": used.generated_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": used.reused_tokens,
    }


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    function = call["function"]
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        arguments = {"arguments": function["arguments"]}
    return {"type": "tool_use", "id": call["id"], "name": function["name"], "input": arguments}


def response(model: str, result: GenerationResult) -> dict[str, Any]:
    """The non-streamed answer: a `message` with thinking, text and tool_use blocks."""
    content: list[dict[str, Any]] = []
    if result.reasoning:
        content.append({"type": "thinking", "thinking": result.reasoning, "signature": ""})
    if result.text or not result.tool_calls:
        content.append({"type": "text", "text": result.text})
    content += [_tool_use(call.model_dump()) for call in result.tool_calls or ()]
    return {
        "id": f"msg_{result.job_id}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": STOP_REASONS.get(result.finish_reason, "end_turn"),
        "stop_sequence": None,
        "usage": usage(result),
    }


@dataclass
class MessageStream:
    """Anthropic's event sequence: message_start, per block content_block_start / _delta / _stop
    (thinking, text, tool_use), message_delta (stop_reason, usage), message_stop."""

    job_id: str
    model: str
    flavor: Flavor = "anthropic"
    block: str | None = None  # the open block's type
    index: int = -1
    reason: str = "end_turn"

    def head(self) -> list[bytes]:
        message: dict[str, Any] = {
            "id": f"msg_{self.job_id}",
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage(None),
        }
        return [named_event({"type": "message_start", "message": message})]

    def ping(self) -> bytes:
        """Anthropic's keep-alive event, sent while the first token is still to come (sse.Pinging)."""
        return named_event({"type": "ping"})

    def _open(self, block: dict[str, Any]) -> list[bytes]:
        events = self._close()
        self.index += 1
        self.block = block["type"]
        return [
            *events,
            named_event({"type": "content_block_start", "index": self.index, "content_block": block}),
        ]

    def _close(self) -> list[bytes]:
        """The open block's end; a thinking block's signature first, as Anthropic streams it (empty:
        a local model signs nothing, and kvrq takes the block back unsigned)."""
        if self.block is None:
            return []
        signed = (
            [self._delta({"type": "signature_delta", "signature": ""})] if self.block == "thinking" else []
        )
        self.block = None
        return [*signed, named_event({"type": "content_block_stop", "index": self.index})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return named_event({"type": "content_block_delta", "index": self.index, "delta": delta})

    def event(self, event: StreamEvent) -> list[bytes]:
        if event.kind == "delta" and event.text:
            head = [] if self.block == "text" else self._open({"type": "text", "text": ""})
            return [*head, self._delta({"type": "text_delta", "text": event.text})]
        if event.kind == "reasoning" and event.text:
            head = (
                []
                if self.block == "thinking"
                else self._open({"type": "thinking", "thinking": "", "signature": ""})
            )
            return [*head, self._delta({"type": "thinking_delta", "thinking": event.text})]
        if event.kind == "tool_call" and event.data is not None:
            block = {**_tool_use(event.data), "input": {}}
            arguments = json.dumps(_tool_use(event.data)["input"], ensure_ascii=False)
            return [
                *self._open(block),
                self._delta({"type": "input_json_delta", "partial_json": arguments}),
                *self._close(),
            ]
        if event.kind == "end":
            self.reason = STOP_REASONS.get(event.finish_reason or "stop", "end_turn")
            head = self._open({"type": "text", "text": ""}) if self.index < 0 else []
            return [*head, *self._close()]
        return []

    def tail(self, result: GenerationResult | None) -> list[bytes]:
        return self.usage_tail(None if result is None else result.usage)

    def usage_tail(self, used: Usage | None) -> list[bytes]:
        """message_delta (stop_reason, usage) and message_stop (sse.UsageTail: read off the end event)."""
        delta = {"stop_reason": self.reason, "stop_sequence": None}
        return [
            named_event({"type": "message_delta", "delta": delta, "usage": usage_of(used)}),
            named_event({"type": "message_stop"}),
        ]
