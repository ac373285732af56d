"""Pydantic models of a generation job: what a producer sends and what a worker returns.

The worker validates every payload again with the same `GenerationRequest`: a job written
by another client (plain rq, another language) is untrusted input.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from producer.wire.ids import agent_id_problem

# Strict scalars: JSON's true is not the number 1, nor 1 the boolean true (the APIs type them apart).
StrictInt = Annotated[int, Field(strict=True)]
StrictFloat = Annotated[float, Field(strict=True)]  # an integer is still a number
StrictBool = Annotated[bool, Field(strict=True)]

QUEUE_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
MAX_PROMPT_CHARS = 1_000_000
MAX_MESSAGES = 1024
MAX_TOKENS_LIMIT = 32768
MAX_STOP_STRINGS = 16
MAX_METADATA_BYTES = 64 * 1024
MAX_TOOLS = 128
MAX_LOGIT_BIAS = 1024
MAX_TOP_LOGPROBS = 20
#: Levels of objects and arrays any client JSON may nest (a whole HTTP body, and each free-form field
#: of a job): pydantic's serializer gives up near 300 and Python's recursion near 1,000, so a deeper
#: value would fail after it was accepted (producer.models.json_depth_problem is the rule).
MAX_JSON_DEPTH = 64
#: A temperature above 0 and below this samples as 0 (greedy), which it is in effect.
MIN_TEMPERATURE = 1e-6
TOOL_NAME_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"
#: apply_chat_template arguments kvrq sets itself: a request's chat_template_kwargs may not.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tools", "documents", "add_generation_prompt", "tokenize", "return_dict"}
)

#: Fields that steer rq (which queue, how long) rather than generation; not part of the job payload.
QUEUE_OPTION_FIELDS = frozenset({"queue", "at_front", "job_timeout", "result_ttl", "retries"})

#: "tool_calls": the row ended on a complete tool call (its calls are in `GenerationResult.tool_calls`).
FinishReason = Literal["stop", "length", "canceled", "tool_calls"]


class TextPart(BaseModel):
    """One part of a message's content in OpenAI's list form; text is the only kind a text model takes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["text"]
    text: str = Field(max_length=MAX_PROMPT_CHARS)


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=TOOL_NAME_PATTERN)
    arguments: str = Field(
        max_length=MAX_PROMPT_CHARS, description="the call's arguments as a JSON string (OpenAI's shape)"
    )


class ToolCall(BaseModel):
    """A function call an assistant made: in a message's history and in a result."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    """One chat message. `content` may be None only on an assistant message that carries `tool_calls`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    role: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_-]{0,31}$")
    content: str | list[TextPart] | None = Field(default=None, max_length=MAX_PROMPT_CHARS)
    tool_calls: list[ToolCall] | None = Field(default=None, min_length=1, max_length=MAX_TOOLS)
    tool_call_id: str | None = Field(default=None, min_length=1, max_length=256)
    name: str | None = Field(default=None, min_length=1, max_length=256)
    reasoning: str | None = Field(
        default=None,
        max_length=MAX_PROMPT_CHARS,
        description="an assistant's thinking, for templates that render it",
    )

    @model_validator(mode="after")
    def _fields_fit_the_role(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content may be left out only on an assistant message with tool_calls")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"only assistant messages carry tool_calls, not {self.role!r} ones")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError(f"tool_call_id belongs on tool messages, not {self.role!r} ones")
        return self

    @property
    def text(self) -> str:
        """The content as one string (text parts joined, as OpenAI concatenates them)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def size(self) -> int:
        """Characters this message adds to a prompt: content, reasoning and tool call arguments."""
        calls = sum(len(call.function.name) + len(call.function.arguments) for call in self.tool_calls or ())
        return len(self.text) + len(self.reasoning or "") + calls

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it (tool call arguments as parsed JSON, as templates expect)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text}
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": call.type,
                    "function": {"name": call.function.name, "arguments": _arguments_object(call.function)},
                }
                for call in self.tool_calls
            ]
        for key in ("tool_call_id", "name", "reasoning"):
            if (value := getattr(self, key)) is not None:
                message[key] = value
        if self.reasoning is not None:
            message["reasoning_content"] = self.reasoning  # the name Qwen / DeepSeek templates read
        return message


def _arguments_object(function: ToolCallFunction) -> Any:
    try:
        return json.loads(function.arguments)
    except ValueError:
        return function.arguments


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=TOOL_NAME_PATTERN, description="1 to 64 letters, digits, _ . -")
    description: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)
    parameters: dict[str, Any] | None = Field(default=None, description="JSON Schema of the arguments")
    strict: StrictBool | None = None

    @field_validator("parameters")
    @classmethod
    def _parameters_are_a_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if value is None else checked_json_schema(value)


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=TOOL_NAME_PATTERN)


class NamedToolChoice(BaseModel):
    """`{"type": "function", "function": {"name": ...}}`: call this tool."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["function"]
    function: ToolChoiceFunction


ToolChoice = Literal["auto", "none", "required"] | NamedToolChoice


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["json_object"]


class JsonSchemaSpec(BaseModel):
    # `schema` would shadow a BaseModel attribute: the field is `json_schema`, "schema" on the wire.
    model_config = ConfigDict(extra="forbid", frozen=True, validate_by_name=True, serialize_by_alias=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: StrictBool | None = None

    @field_validator("json_schema")
    @classmethod
    def _is_a_schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        return checked_json_schema(value)


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class TopLogprob(BaseModel):
    token: str
    token_id: int
    logprob: float
    bytes: list[int] | None = Field(
        description="the token's UTF-8 bytes (a token may hold part of a character)"
    )


class TokenLogprob(TopLogprob):
    """One generated token's log probability and the `top_logprobs` most likely tokens at its step."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


def checked_json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` if it is a valid JSON Schema (by its metaschema), else ValueError saying where."""
    _check_json(schema, "the schema")
    from jsonschema import exceptions, validators  # imported here: only requests with schemas pay for it

    validator = validators.validator_for(schema, default=validators.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except exceptions.SchemaError as exc:
        where = "/".join(str(part) for part in exc.absolute_path) or "(root)"
        raise ValueError(f"invalid JSON schema at {where}: {exc.message}") from None
    return schema


def json_depth_problem(value: Any, what: str, limit: int = MAX_JSON_DEPTH) -> str | None:
    """Why `value` nests too deeply (naming where), or None. A loop, not recursion: the values it
    catches are the ones deep enough to break recursive code."""
    # (container, its depth, its parent's entry, its key there): paths are spelled only for the answer
    Entry = tuple[Any, int, Any, object]
    pending: list[Entry] = [(value, 1, None, what)] if isinstance(value, dict | list) else []
    while pending:
        entry = pending.pop()
        item, depth = entry[0], entry[1]
        if depth > limit:
            return f"{_json_path(entry)} nests objects and arrays deeper than {limit} levels"
        pairs = item.items() if isinstance(item, dict) else enumerate(item)
        pending += [(child, depth + 1, entry, key) for key, child in pairs if isinstance(child, dict | list)]
    return None


def _json_path(entry: tuple[Any, int, Any, object]) -> str:
    """`what.key[0].key` down to the entry's first 8 levels (enough to find it, short enough to read)."""
    keys: list[object] = []
    while entry is not None:
        keys.append(entry[3])
        entry = entry[2]
    keys.reverse()
    shown = "".join(f"[{key}]" if isinstance(key, int) else f".{key}" for key in keys[1:9])
    return f"{keys[0]}{shown}{'...' if len(keys) > 9 else ''}"


def _check_json(value: Any, what: str, limit: int = MAX_METADATA_BYTES) -> None:
    if problem := json_depth_problem(value, what):
        raise ValueError(problem)
    try:
        encoded = json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} must be JSON-serializable: {exc}") from None
    if len(encoded) > limit:
        raise ValueError(f"{what} is {len(encoded)} bytes as JSON, the limit is {limit}")


NAMESPACE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


class GenerationRequest(BaseModel):
    """One generation job. Exactly one of `prompt` (raw text) or `messages` (chat) is given."""

    # `continue` is a Python keyword: the field is `continue_`, "continue" on the wire.
    model_config = ConfigDict(
        extra="forbid", validate_by_name=True, validate_by_alias=True, serialize_by_alias=True
    )

    agent_id: str | None = Field(
        default=None,
        description="resume from and save to this agent's KV cache; None for a one-off job "
        "(the rule: producer.wire.protocol.agent_id_problem)",
    )
    continue_: StrictBool = Field(
        default=False,
        alias="continue",
        description="append `messages` to the agent's stored conversation and resume it (needs agent_id); "
        "the first such job of an agent starts its conversation",
    )
    fork_from: str | None = Field(
        default=None,
        description="start agent_id as a copy of this agent's conversation and KV (blocks shared, "
        "not copied), then append `messages`; agent_id must not have a conversation yet",
    )
    namespace: str | None = Field(
        default=None,
        pattern=NAMESPACE_PATTERN,
        description="narrows the worker's namespace (the tenant whose shared prefixes this job may reuse "
        "and feed): the job's reuse stays inside <worker namespace>/<namespace>; never wider",
    )
    prompt: str | None = Field(default=None, min_length=1, max_length=MAX_PROMPT_CHARS)
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=MAX_MESSAGES)
    max_tokens: StrictInt = Field(default=256, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: StrictFloat = Field(default=0.0, ge=0.0, le=100.0)
    top_p: StrictFloat = Field(default=1.0, gt=0.0, le=1.0)
    seed: StrictInt | None = Field(default=None, ge=0, lt=2**63)
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    metadata: dict[str, Any] = Field(default_factory=dict, description="opaque, echoed back in the result")
    # Samplers and logits processors (mlx-lm's meanings); each row of a batch has its own.
    top_k: StrictInt = Field(default=0, ge=0, description="keep the k most likely tokens; 0: all")
    min_p: StrictFloat = Field(
        default=0.0, ge=0.0, le=1.0, description="drop tokens below min_p x the top probability"
    )
    repetition_penalty: StrictFloat | None = Field(default=None, gt=0.0, le=100.0)
    repetition_context_size: StrictInt = Field(
        default=20, ge=1, le=MAX_TOKENS_LIMIT, description="last tokens the three penalties look at"
    )
    presence_penalty: StrictFloat = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, StrictFloat] | None = Field(
        default=None,
        max_length=MAX_LOGIT_BIAS,
        description="token id (a string, OpenAI's shape) -> bias added",
    )
    logprobs: StrictBool = Field(default=False, description="return each generated token's log probability")
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # Tools, structured output and template options (chat requests).
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description="extra variables for the chat template (e.g. enable_thinking)"
    )
    max_tokens_fit: bool = Field(
        default=False,
        description="cut max_tokens to what the model's context leaves after the prompt (the answer ends "
        "'length' there) instead of refusing the job; kvrq serve sets it (clients send max_tokens "
        "beyond a local model's context)",
    )

    # Queue options (rq): not sent to the worker as part of the payload.
    queue: str | None = Field(
        default=None, pattern=QUEUE_NAME_PATTERN, description="queue name (default: producer's)"
    )
    at_front: StrictBool = Field(default=False, description="enqueue at the head of the queue (priority)")
    job_timeout: StrictInt | None = Field(
        default=None, gt=0, description="seconds a job may run once started"
    )
    result_ttl: StrictInt | None = Field(
        default=None, ge=-1, description="seconds the result is kept (-1: forever)"
    )
    retries: StrictInt = Field(
        default=0, ge=0, le=100, description="re-runs after a failure or a worker crash"
    )

    @field_validator("agent_id", "fork_from")
    @classmethod
    def _agent_id_is_safe(cls, value: str | None) -> str | None:
        problem = None if value is None else agent_id_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value

    @field_validator("messages")
    @classmethod
    def _messages_fit_one_prompt(cls, value: list[ChatMessage] | None) -> list[ChatMessage] | None:
        total = sum(message.size() for message in value or ())
        if total > MAX_PROMPT_CHARS:
            raise ValueError(f"messages hold {total:,} characters in all, the limit is {MAX_PROMPT_CHARS:,}")
        return value

    @field_validator("temperature")
    @classmethod
    def _tiny_temperature_is_greedy(cls, value: float) -> float:
        # The sampler scales by 1/temperature in float32: below ~3e-39 that is inf and the grammar's
        # mask turns to NaN (a fuzzed 6e-288 got a token the grammar refused); far above, it is greedy.
        return 0.0 if value < MIN_TEMPERATURE else value

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: list[str]) -> list[str]:
        for item in value:
            if not item or len(item) > 256:
                raise ValueError("each stop string must have 1 to 256 characters")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_is_json(cls, value: dict[str, Any]) -> dict[str, Any]:
        _check_json(value, "metadata")
        return value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs_are_json(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            _check_json(value, "chat_template_kwargs")
            if reserved := sorted(RESERVED_TEMPLATE_KWARGS & value.keys()):
                raise ValueError(
                    f"chat_template_kwargs may not set {', '.join(reserved)}: kvrq sets them (send 'tools')"
                )
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_keys_are_token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.isdigit() or not key.isascii():
                raise ValueError(f"logit_bias keys are token ids (non-negative integers), not {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias[{key}] is {bias}; biases lie in [-100, 100]")
        return value

    @field_validator("tools")
    @classmethod
    def _tool_names_are_unique(cls, value: list[Tool] | None) -> list[Tool] | None:
        names = [tool.function.name for tool in value or ()]
        if twice := sorted({name for name in names if names.count(name) > 1}):
            raise ValueError(f"tool names must be unique: {', '.join(twice)} offered twice")
        return value

    @model_validator(mode="after")
    def _prompt_xor_messages(self) -> GenerationRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.prompt is not None and (self.tools or self.chat_template_kwargs):
            raise ValueError(
                "tools and chat_template_kwargs go with 'messages' (a chat template renders them)"
            )
        self._check_tool_choice()
        self._check_memory()
        return self

    def _check_memory(self) -> None:
        if not (self.continue_ or self.fork_from):
            return
        what = "continue" if self.continue_ else "fork_from"
        if self.agent_id is None:
            raise ValueError(f"{what} needs an agent_id: the agent whose conversation the job extends")
        if self.messages is None:
            raise ValueError(f"{what} appends chat messages to a conversation: send 'messages', not 'prompt'")
        if self.fork_from is not None and self.fork_from == self.agent_id:
            raise ValueError(f"an agent cannot fork from itself: fork_from is agent_id {self.agent_id!r}")

    @property
    def extends_conversation(self) -> bool:
        """The job's messages go after a stored conversation (its agent's, or fork_from's)."""
        return self.continue_ or self.fork_from is not None

    def _check_tool_choice(self) -> None:
        choice = self.tool_choice
        if choice is None or choice in ("auto", "none"):
            return
        offered = [tool.function.name for tool in self.tools or ()]
        if not offered:
            raise ValueError(f"tool_choice {tool_choice_text(choice)} needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in offered:
            raise ValueError(
                f"tool_choice names {choice.function.name!r}, which is not among the tools offered "
                f"({', '.join(offered)})"
            )

    @property
    def logit_bias_ids(self) -> dict[int, float]:
        """logit_bias with integer token ids."""
        return {int(key): bias for key, bias in (self.logit_bias or {}).items()}

    def job_payload(self) -> dict[str, Any]:
        """The JSON dict rq carries to the worker: the generation fields, queue options left out.

        Options at their neutral default are left out too, so a plain request's payload reads as before.
        """
        payload = self.model_dump(mode="json", exclude=set(QUEUE_OPTION_FIELDS), exclude_none=True)
        fields = type(self).model_fields
        for name in _LEFT_OUT_AT_DEFAULT:
            key = fields[name].alias or name
            if key in payload and payload[key] == fields[name].default:
                del payload[key]
        return payload


_LEFT_OUT_AT_DEFAULT = (
    "top_k",
    "min_p",
    "repetition_context_size",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "continue_",
    "max_tokens_fit",
)


def tool_choice_text(choice: ToolChoice) -> str:
    """A tool_choice as error messages name it: 'required', function 'f'."""
    return repr(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"


class Usage(BaseModel):
    prompt_tokens: int
    reused_tokens: int = Field(description="prompt tokens whose KV came from the agent's saved cache")
    prefilled_tokens: int = Field(description="prompt tokens run through the model for this job")
    generated_tokens: int


class Timings(BaseModel):
    """Seconds, measured by the worker from the job's `enqueued_at` (rq)."""

    queued_s: float = Field(description="enqueue until the job entered the engine (incl. cache load)")
    time_to_first_token_s: float | None = Field(description="enqueue until the first generated token")
    total_s: float = Field(description="enqueue until the result was ready")
    cache_load_s: float = Field(default=0.0, description="reading the agent's cache from the store")
    engine_time_to_first_token_s: float | None = Field(
        default=None,
        description="the engine's own part: from its submit() to the step() that returned the first token",
    )


class SchemaCheck(BaseModel):
    """A response_format answer validated against its full schema when it ended (worker/schema_check.py).

    The grammar cannot hold every keyword (`not`, `if`/`then`, `uniqueItems`, ...): those are named in
    `unenforced`, and an answer that breaks one (or that max_tokens cut) has `valid` false and the reason.
    """

    valid: bool
    violation: str | None = Field(default=None, description="where and how the answer breaks its schema")
    unenforced: list[str] = Field(
        default_factory=list, description="what of the schema the grammar did not enforce while decoding"
    )


class GenerationResult(BaseModel):
    """The rq return value of a finished job (stored as JSON).

    `text` is the answer: with tools or a template that marks thinking, the tool-call and reasoning
    text are taken out of it into `tool_calls` and `reasoning`; `token_ids` are every generated token.
    """

    job_id: str
    agent_id: str | None
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    tool_calls: list[ToolCall] | None = None
    reasoning: str | None = None
    logprobs: list[TokenLogprob] | None = None
    usage: Usage
    timings: Timings
    metadata: dict[str, Any] = Field(default_factory=dict)
    model: str = ""
    worker: str = ""
    schema_check: SchemaCheck | None = Field(
        default=None, description="with response_format json_object / json_schema: the answer checked"
    )
