"""The OpenAPI document of `kvrq serve` (`/openapi.json`): every route, its body, its answers, its errors.

The routes read their raw bodies (each API's parser gives its own 400s), so FastAPI cannot see their
shapes: the models here declare them for the document only and change no parsing. They describe what
kvrq takes (fields it does not know are refused, so the document lists none it does not), what it
answers (the fields every answer has; more may come), and each API's error shape, which every 4xx and
5xx has. tests/http/test_openapi_fuzz.py holds a real server to this document with schemathesis.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Annotated, Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import models_json_schema

from producer.http.body import AnthropicDropped, OpenAIDropped, ResponsesDropped
from producer.http.conversations import MAX_LIST_LIMIT
from producer.http.errors import flavor_of
from producer.models import (
    MAX_MESSAGES,
    MAX_PROMPT_CHARS,
    MAX_STOP_STRINGS,
    MAX_TOKENS_LIMIT,
    MAX_TOOLS,
    MAX_TOP_LOGPROBS,
    ResponseFormat,
    Tool,
    ToolChoice,
)
from producer.openai_shapes.bodies import CHAT_URL, COMPLETIONS_URL

Text = Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]
MaxTokens = Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)]
Temperature = Annotated[float, Field(ge=0.0, le=100.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
Stops = Annotated[
    list[Annotated[str, Field(min_length=1, max_length=256)]], Field(max_length=MAX_STOP_STRINGS)
]


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Memory(_Closed):
    """kvrq's own `kvrq` object: resume or fork an agent's conversation (docs/http.md)."""

    continue_: bool | None = Field(default=None, alias="continue")
    fork_from: str | None = None
    namespace: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class Samplers(_Closed):
    """Sampling fields kvrq takes beside each API's own (mlx-lm's meanings)."""

    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)


class TextPart(_Closed):
    type: Literal["text"]
    text: Text


class Message(_Closed):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: str | None = Field(default=None, min_length=1, max_length=256)
    tool_call_id: str | None = Field(default=None, min_length=1, max_length=256)
    tool_calls: list[dict[str, Any]] | None = None


class StreamOptions(_Closed):
    include_usage: bool | None = None


class OpenAIBody(OpenAIDropped, Samplers):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: MaxTokens | None = Field(default=None, description="null or absent: 256 (kvrq's default)")
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stop: Annotated[str, Field(min_length=1, max_length=256)] | Stops | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    prompt_cache_key: str | None = Field(default=None, description="the agent whose cache to resume")
    kvrq: Memory | None = None


class ChatBody(OpenAIBody):
    """POST /v1/chat/completions."""

    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionBody(OpenAIBody):
    """POST /v1/completions (max_tokens defaults to 16, as OpenAI's)."""

    prompt: Text
    logprobs: int | None = Field(default=None, ge=0, le=5)


class AnthropicBlock(_Closed):
    type: Literal["text"]
    text: Text


class AnthropicToolUse(_Closed):
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    input: dict[str, Any]


class AnthropicToolResult(_Closed):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: Text | list[AnthropicBlock] | None = None
    is_error: bool | None = None


class AnthropicMessage(_Closed):
    role: Literal["user", "assistant"]
    content: Text | list[AnthropicBlock | AnthropicToolUse | AnthropicToolResult]


class AnthropicTool(_Closed):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]


class CountTokensBody(AnthropicDropped):
    """POST /v1/messages/count_tokens."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: Text | list[AnthropicBlock] | None = None
    tools: list[AnthropicTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: dict[str, Any] | None = None
    kvrq: Memory | None = None


class MessagesBody(CountTokensBody):
    """POST /v1/messages (the agent: metadata.user_id or X-Kvrq-Agent)."""

    max_tokens: MaxTokens
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: int | None = Field(default=None, ge=0)
    stop_sequences: Stops | None = None
    stream: bool | None = None


class InputText(_Closed):
    type: Literal["input_text", "output_text"]
    text: Text


class InputMessage(_Closed):
    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | list[InputText]


class FunctionCall(_Closed):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    arguments: str


class FunctionCallOutput(_Closed):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: Text


InputItems = list[InputMessage | FunctionCall | FunctionCallOutput]


class ResponsesBody(ResponsesDropped, Samplers):
    """POST /v1/responses."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)] | InputItems
    instructions: Text | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: bool | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: str | None = None
    prompt_cache_key: str | None = None
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None


Metadata = Annotated[dict[str, Annotated[str, Field(max_length=512)]], Field(max_length=16)]


class ConversationBody(_Closed):
    """POST /v1/conversations."""

    items: InputItems | None = None
    metadata: Metadata | None = None


class ConversationUpdate(_Closed):
    """POST /v1/conversations/{id}."""

    metadata: Metadata


# ---- answers: the fields each always has ----


class OpenAIErrorDetail(BaseModel):
    model_config = ConfigDict(extra="forbid")

    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIError(BaseModel):
    """Every error of the OpenAI-shaped routes (all but /v1/messages*)."""

    model_config = ConfigDict(extra="forbid")

    error: OpenAIErrorDetail


class AnthropicErrorDetail(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: str
    message: str


class AnthropicError(BaseModel):
    """Every error of /v1/messages and /v1/messages/count_tokens."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["error"]
    error: AnthropicErrorDetail


class Service(BaseModel):
    service: Literal["kvrq"]


class Health(BaseModel):
    status: Literal["ok"]
    models: list[str]


class HealthDown(BaseModel):
    status: Literal["unavailable"]
    reason: str


class ModelList(BaseModel):
    """OpenAI's shape, or Anthropic's (has_more, first_id, last_id) when `anthropic-version` is sent."""

    data: list[dict[str, Any]]


class Completion(BaseModel):
    id: str
    object: Literal["chat.completion", "text_completion"]
    created: int
    model: str
    choices: list[dict[str, Any]] = Field(min_length=1)
    usage: dict[str, Any]


class AnthropicAnswer(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    content: list[dict[str, Any]]
    stop_reason: str
    usage: dict[str, Any]


class TokenCount(BaseModel):
    input_tokens: int = Field(ge=0)


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"]
    created_at: int
    status: str
    output: list[dict[str, Any]]


class Conversation(BaseModel):
    id: str
    object: Literal["conversation"]
    created_at: int
    metadata: dict[str, Any]


class Deleted(BaseModel):
    id: str
    object: Literal["response.deleted", "conversation.deleted"]
    deleted: Literal[True]


class ItemPage(BaseModel):
    object: Literal["list"]
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


STREAMED = frozenset({CHAT_URL, COMPLETIONS_URL, "/v1/messages", "/v1/responses"})
#: (method, path) -> (request body model or None, 200 answer model)
OPERATIONS: dict[tuple[str, str], tuple[type[BaseModel] | None, type[BaseModel]]] = {
    ("get", "/"): (None, Service),
    ("head", "/"): (None, Service),
    ("get", "/health"): (None, Health),
    ("get", "/v1/models"): (None, ModelList),
    ("post", CHAT_URL): (ChatBody, Completion),
    ("post", COMPLETIONS_URL): (CompletionBody, Completion),
    ("post", "/v1/messages"): (MessagesBody, AnthropicAnswer),
    ("post", "/v1/messages/count_tokens"): (CountTokensBody, TokenCount),
    ("post", "/v1/responses"): (ResponsesBody, ResponseObject),
    ("get", "/v1/responses/{response_id}"): (None, ResponseObject),
    ("delete", "/v1/responses/{response_id}"): (None, Deleted),
    ("get", "/v1/responses/{response_id}/input_items"): (None, ItemPage),
    ("post", "/v1/conversations"): (ConversationBody, Conversation),
    ("get", "/v1/conversations/{ident}"): (None, Conversation),
    ("post", "/v1/conversations/{ident}"): (ConversationUpdate, Conversation),
    ("delete", "/v1/conversations/{ident}"): (None, Deleted),
    ("get", "/v1/conversations/{ident}/items"): (None, ItemPage),
}
HI = [{"role": "user", "content": "Hi!"}]
#: A request body that works, per model (the fuzzer's first cases; a reader's too).
EXAMPLES: dict[type[BaseModel], dict[str, Any]] = {
    ChatBody: {"messages": HI, "max_tokens": 4},
    CompletionBody: {"prompt": "Once upon a time", "max_tokens": 4},
    MessagesBody: {"messages": HI, "max_tokens": 4},
    CountTokensBody: {"messages": HI},
    ResponsesBody: {"input": "Hi!", "max_output_tokens": 4},
    ConversationBody: {"items": HI, "metadata": {"topic": "demo"}},
    ConversationUpdate: {"metadata": {"topic": "demo"}},
}
PAGED = frozenset({"/v1/responses/{response_id}/input_items", "/v1/conversations/{ident}/items"})
PAGING = [
    {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": MAX_LIST_LIMIT}},
    {"name": "order", "in": "query", "schema": {"type": "string", "enum": ["asc", "desc"]}},
    {"name": "after", "in": "query", "schema": {"type": "string"}},
]
#: One server-sent event (before OpenAPI 3.2, an event stream's `schema` describes each event); its data
#: is a JSON object, or OpenAI's closing `[DONE]`.
SSE_EVENT = {
    "type": "object",
    "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
    "required": ["data"],
}
SECURITY = {
    "bearer": {"type": "http", "scheme": "bearer", "description": "kvrq serve --api-key-file"},
    "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
}


def install(app: FastAPI) -> None:
    """Serve `document(app)` as the app's OpenAPI document (built once, on the first ask)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = document(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def document(app: FastAPI) -> dict[str, Any]:
    """FastAPI's paths (routes, path parameters) with each operation's body and answers from OPERATIONS
    (one missing there gets only the error shapes: tests/http/test_openapi.py names it)."""
    with warnings.catch_warnings():  # GET and HEAD of one function: FastAPI warns of their shared id
        warnings.simplefilter("ignore", UserWarning)
        spec = get_openapi(title="kvrq", version=app.version, routes=app.routes, description=__doc__)
    models: list[type[BaseModel]] = [OpenAIError, AnthropicError, HealthDown]
    models += [model for pair in OPERATIONS.values() for model in pair if model is not None]
    keyed: list[tuple[type[BaseModel], Literal["validation"]]] = [
        (model, "validation") for model in dict.fromkeys(models)
    ]
    refs, defs = models_json_schema(keyed, ref_template="#/components/schemas/{model}")

    def ref(model: type[BaseModel]) -> dict[str, Any]:
        return {"schema": refs[(model, "validation")]}

    spec["components"] = {"schemas": defs.get("$defs", {}), "securitySchemes": SECURITY}
    spec["security"] = [{}, {"bearer": []}, {"apiKey": []}]  # a key only where the server asks for one
    for path, item in spec["paths"].items():
        for method, operation in item.items():
            body, answer = OPERATIONS.get((method, path), (None, None))
            operation["operationId"] = f"{method}_{path}"  # GET and HEAD of one function share FastAPI's
            operation["responses"] = _responses(path, None if answer is None else ref(answer), ref)
            if method == "head":
                operation["responses"]["200"].pop("content")
            if body is not None:
                content = {**ref(body), "example": EXAMPLES[body]}
                operation["requestBody"] = {"required": True, "content": {"application/json": content}}
            if path in PAGED:
                operation["parameters"] = [*operation.get("parameters", []), *PAGING]
    return spec


def _responses(
    path: str, answer: dict[str, Any] | None, ref: Callable[[type[BaseModel]], dict[str, Any]]
) -> dict[str, Any]:
    ok: dict[str, Any] = {"application/json": answer or {"schema": {"type": "object"}}}
    if path in STREAMED:
        ok["text/event-stream"] = {"schema": SSE_EVENT}
    error = {"application/json": ref(AnthropicError if flavor_of(path) == "anthropic" else OpenAIError)}
    responses = {
        "200": {"description": "the answer (a stream of events with `stream`: true)", "content": ok},
        "4XX": {"description": "the request cannot be served as sent", "content": error},
        "5XX": {"description": "no worker, Redis down, a timeout, or a bug", "content": error},
    }
    if path == "/health":
        down = {"application/json": ref(HealthDown)}
        responses["503"] = {"description": "Redis is unreachable", "content": down}
    return responses
