"""OpenAI's `/v1/chat/completions` and `/v1/completions`: bodies to GenerationRequest fields, results and
stream events back to OpenAI's shapes.

The body mapping is the OpenAI Batch one (producer/openai_shapes/: the same bodies, the same checks:
an unknown field or one kvrq cannot honour is refused, never dropped); on top of it this module takes
the fields only a live request has: `stream`, `stream_options` and `prompt_cache_key` (the agent).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from producer.http.errors import Flavor, invalid
from producer.http.ignored import ignore
from producer.http.memory_fields import client_agent, memory_fields
from producer.http.sse import DONE, data_event
from producer.models import GenerationResult, Usage
from producer.openai_shapes.answers import chat_logprob, completion_logprobs, openai_usage, response_body
from producer.openai_shapes.bodies import CHAT_URL, BodyError, chat_request, completion_request
from producer.wire.protocol import StreamEvent


@dataclass(frozen=True)
class Parsed:
    """A request body taken apart: the model it names, GenerationRequest fields, how to answer."""

    url: str
    model: str | None
    fields: dict[str, Any]
    stream: bool = False
    include_usage: bool = False


def parse(url: str, body: dict[str, Any], *, agent: str | None = None) -> Parsed:
    """`body` of a chat (CHAT_URL) or completions request; `agent` (the X-Kvrq-Agent header) stands in
    for `prompt_cache_key`. Raises APIError 400 saying what is wrong."""
    body = dict(body)
    stream = body.pop("stream", None)
    if stream is not None and not isinstance(stream, bool):
        raise invalid("'stream' must be true or false", param="stream")
    options = body.pop("stream_options", None)
    include_usage = False
    if options is not None:
        if not stream:
            raise invalid("'stream_options' goes with 'stream': true", param="stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage", "include_obfuscation"}:
            raise invalid("'stream_options' takes 'include_usage' (true or false)", param="stream_options")
        include_usage = bool(options.get("include_usage"))
    key = body.pop("prompt_cache_key", None)
    if key is not None and not isinstance(key, str):
        raise invalid("'prompt_cache_key' must be a string (the agent whose cache to resume)")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("'model' must be a string", param="model")
    memory = memory_fields(body)
    if url == CHAT_URL:
        body = narrowed_to_allowed_tools(_without_ignored(body))
    try:
        fields = chat_request(body) if url == CHAT_URL else completion_request(body)
    except BodyError as exc:
        raise invalid(exc.message.replace("body.", "")) from None
    fields.update(memory)
    if agent or key:
        fields["agent_id"] = client_agent(agent or key, "the agent (prompt_cache_key or X-Kvrq-Agent)")
    return Parsed(url, model, fields, bool(stream), include_usage)


#: Chat fields the API defines that change nothing here: taken out of the body and named in
#: x-kvrq-ignored (batch runs take the first four silently: producer/openai_shapes/bodies.py).
CHAT_IGNORED_FIELDS = (
    "user",
    "store",
    "metadata",
    "service_tier",
    "safety_identifier",
    "prompt_cache_retention",
    "verbosity",
    "prediction",
    "web_search_options",  # a hosted tool: kvrq searches nothing
)


def _without_ignored(body: dict[str, Any]) -> dict[str, Any]:
    """`body` without CHAT_IGNORED_FIELDS (each named), `modalities: ["text"]` (what kvrq answers
    anyway) and `reasoning_effort`, which becomes the template's enable_thinking (`none`: off)."""
    out = dict(body)
    for name in CHAT_IGNORED_FIELDS:
        if out.pop(name, None) is not None:
            ignore(name)
    if out.get("modalities") == ["text"]:
        del out["modalities"]
    effort = out.pop("reasoning_effort", None)
    kwargs = out.get("chat_template_kwargs")
    if effort is not None and (kwargs is None or isinstance(kwargs, dict)):  # another: pydantic's 400
        out["chat_template_kwargs"] = {"enable_thinking": effort != "none", **(kwargs or {})}
    return out


def narrowed_to_allowed_tools(body: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's `tool_choice: {"type": "allowed_tools", "allowed_tools": {"mode", "tools"}}` as kvrq
    takes it: the model is offered only the listed tools (the prompt holds just those), and `mode`
    (auto or required) is the choice among them."""
    choice = body.get("tool_choice")
    if not isinstance(choice, dict) or choice.get("type") != "allowed_tools":
        return body
    allowed = choice.get("allowed_tools")
    mode = allowed.get("mode") if isinstance(allowed, dict) else None
    listed = allowed.get("tools") if isinstance(allowed, dict) else None
    if mode not in ("auto", "required") or not isinstance(listed, list) or not listed:
        raise invalid(
            "tool_choice allowed_tools takes allowed_tools: {mode: auto or required, tools: [...]}",
            param="tool_choice",
        )
    offered = {
        tool["function"].get("name"): tool
        for tool in body.get("tools") or ()
        if isinstance(tool, dict) and isinstance(tool.get("function"), dict)
    }
    names = []
    for tool in listed:
        name = tool.get("function", {}).get("name") if isinstance(tool, dict) else None
        if name not in offered:
            raise invalid(f"tool_choice allowed_tools names {name!r}, which is not among the tools offered")
        names.append(name)
    return {**body, "tools": [offered[name] for name in dict.fromkeys(names)], "tool_choice": mode}


def response(parsed: Parsed, model: str, result: GenerationResult) -> dict[str, Any]:
    """The non-streamed answer: a chat.completion or a text_completion, with kvrq's figures under `kvrq`."""
    body = response_body(parsed.url, result.job_id, model, result.model_dump(mode="json"), int(time.time()))
    if result.reasoning and parsed.url == CHAT_URL:
        body["choices"][0]["message"]["reasoning_content"] = result.reasoning
    body["system_fingerprint"] = None
    body["kvrq"] = kvrq_extension(result)
    return body


def kvrq_extension(result: GenerationResult) -> dict[str, Any]:
    """What kvrq adds to a response (OpenAI's clients ignore it): the job, the agent, cache reuse, timings."""
    return {
        "job_id": result.job_id,
        "agent_id": result.agent_id,
        "usage": result.usage.model_dump(),
        "timings": result.timings.model_dump(),
        "worker": result.worker,
        # response_format answers: valid against the full schema, the violation, keywords not enforced.
        "schema_check": None if result.schema_check is None else result.schema_check.model_dump(),
    }


@dataclass
class _Chunks:
    """What both OpenAI streams share: the chunk envelope, text with its token's logprobs in one chunk
    (the worker sends a token's text, then its logprobs), the finish_reason, the usage chunk, `[DONE]`."""

    job_id: str
    model: str
    include_usage: bool
    logprobs: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    flavor: Flavor = "openai"
    object: str = "chat.completion.chunk"
    prefix: str = "chatcmpl-"
    pending: str | None = None  # text waiting for its token's logprobs

    def chunk(self, choice: dict[str, Any] | None) -> bytes:
        return data_event(self.envelope(choice))

    def envelope(self, choice: dict[str, Any] | None) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "id": f"{self.prefix}{self.job_id}",
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": [] if choice is None else [{"index": 0, **choice}],
        }
        if self.include_usage:
            payload["usage"] = None
        return payload

    def event(self, event: StreamEvent) -> list[bytes]:
        if event.kind == "logprobs" and event.data is not None:
            text, self.pending = self.pending or "", None
            return [self.text(text, self.token_logprobs(event.data))]
        out = [] if self.pending is None else [self.text(self.pending, None)]
        self.pending = None
        if event.kind == "delta" and self.logprobs:
            self.pending = event.text
        elif event.kind == "delta" and event.text:
            out.append(self.text(event.text, None))
        elif event.kind == "end":
            reason = event.finish_reason or "stop"
            out.append(self.finish("stop" if reason == "canceled" else reason))
        else:
            out += self.other(event)
        return out

    def tail(self, result: GenerationResult | None) -> list[bytes]:
        return self.usage_tail(None if result is None else result.usage)

    def usage_tail(self, used: Usage | None) -> list[bytes]:
        """The usage chunk when asked, then `[DONE]` (sse.UsageTail: read off the end event)."""
        if not self.include_usage:
            return [DONE]
        usage = {} if used is None else used.model_dump()
        return [data_event({**self.envelope(None), "usage": openai_usage(usage)}), DONE]

    def text(self, text: str, logprobs: dict[str, Any] | None) -> bytes:
        raise NotImplementedError

    def token_logprobs(self, entry: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def finish(self, reason: str) -> bytes:
        raise NotImplementedError

    def other(self, event: StreamEvent) -> list[bytes]:
        return []


@dataclass
class ChatStream(_Chunks):
    """chat.completion.chunk events: the role first, then content (with logprobs), reasoning_content and
    tool_calls deltas, a chunk with the finish_reason, the usage chunk when asked, `[DONE]`."""

    calls: int = 0

    def head(self) -> list[bytes]:
        return [self._delta({"role": "assistant", "content": ""})]

    def _delta(self, delta: dict[str, Any], logprobs: dict[str, Any] | None = None) -> bytes:
        return self.chunk({"delta": delta, "logprobs": logprobs, "finish_reason": None})

    def text(self, text: str, logprobs: dict[str, Any] | None) -> bytes:
        return self._delta({"content": text}, logprobs)

    def token_logprobs(self, entry: dict[str, Any]) -> dict[str, Any]:
        return {"content": [chat_logprob(entry)]}

    def finish(self, reason: str) -> bytes:
        return self.chunk({"delta": {}, "logprobs": None, "finish_reason": reason})

    def other(self, event: StreamEvent) -> list[bytes]:
        if event.kind == "reasoning" and event.text:
            return [self._delta({"reasoning_content": event.text, "reasoning": event.text})]
        if event.kind == "tool_call" and event.data is not None:
            call = {"index": self.calls, **event.data}
            self.calls += 1
            return [self._delta({"tool_calls": [call]})]
        return []


@dataclass
class CompletionStream(_Chunks):
    """text_completion chunks: text (with its token's logprobs when asked), the finish_reason, the usage
    chunk when asked, `[DONE]`."""

    offset: int = 0

    def __post_init__(self) -> None:
        self.object, self.prefix = "text_completion", "cmpl-"

    def head(self) -> list[bytes]:
        return []

    def text(self, text: str, logprobs: dict[str, Any] | None) -> bytes:
        return self.chunk({"text": text, "logprobs": logprobs, "finish_reason": None})

    def token_logprobs(self, entry: dict[str, Any]) -> dict[str, Any]:
        logprobs = completion_logprobs([entry])
        logprobs["text_offset"] = [self.offset]
        self.offset += len(entry["token"])
        return logprobs

    def finish(self, reason: str) -> bytes:
        return self.chunk({"text": "", "logprobs": None, "finish_reason": reason})


def stream_translator(parsed: Parsed, job_id: str, model: str) -> ChatStream | CompletionStream:
    kind = ChatStream if parsed.url == CHAT_URL else CompletionStream
    return kind(job_id, model, parsed.include_usage, bool(parsed.fields.get("logprobs")))
