"""What every request body must be before its route reads it: a JSON object nested at most
MAX_JSON_DEPTH levels, whose fields kvrq accepts and drops typed as the official API types them.

Checked where the request enters, before any job is enqueued: a value that would break code further
on (pydantic's serializer near 300 levels, a recursive save near 1,000) is a 400 naming the field,
never a 500 after the work was done. The parsers (openai_api, anthropic_api, responses_api) keep
their own rules; the models here only add types to fields nothing else reads.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from producer.http.errors import from_validation, invalid
from producer.models import json_depth_problem
from producer.openai_shapes.bodies import CHAT_URL, COMPLETIONS_URL

#: OpenAI's metadata: at most 16 pairs, keys up to 64 characters, string values up to 512.
OpenAIMetadata = Annotated[
    dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]], Field(max_length=16)
]


class _Dropped(BaseModel):
    """Types of fields kvrq takes and drops; any other field is left to the route's parser."""

    model_config = ConfigDict(extra="allow", strict=True)


class OpenAIDropped(_Dropped):
    """Chat and completions: billing, storage and tracking fields."""

    user: str | None = Field(default=None, max_length=256)
    store: bool | None = None
    metadata: OpenAIMetadata | None = None
    service_tier: str | None = Field(default=None, max_length=64)


class ResponsesDropped(_Dropped):
    """/v1/responses: `metadata` is echoed and stored with the response, the rest dropped."""

    user: str | None = Field(default=None, max_length=256)
    safety_identifier: str | None = Field(default=None, max_length=256)
    service_tier: str | None = Field(default=None, max_length=64)
    prompt_cache_retention: str | None = Field(default=None, max_length=64)
    include: list[Annotated[str, Field(max_length=128)]] | None = Field(default=None, max_length=64)
    metadata: OpenAIMetadata | None = None


class AnthropicMetadata(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    user_id: str | None = Field(default=None, max_length=256, description="the agent (kvrq)")


class AnthropicDropped(_Dropped):
    """/v1/messages: routing and billing options; `metadata.user_id` names the agent."""

    metadata: AnthropicMetadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    inference_geo: str | None = Field(default=None, max_length=64)
    workspace_id: str | None = Field(default=None, max_length=256)


#: path -> the model its dropped fields are checked with
DROPPED: dict[str, type[_Dropped]] = {
    CHAT_URL: OpenAIDropped,
    COMPLETIONS_URL: OpenAIDropped,
    "/v1/responses": ResponsesDropped,
    "/v1/messages": AnthropicDropped,
    "/v1/messages/count_tokens": AnthropicDropped,
}


def parsed_body(raw: bytes, path: str) -> dict[str, Any]:
    """`raw` as the JSON object a route at `path` reads; APIError 400 saying what is wrong."""
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise invalid(f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise invalid("the body is nested too deeply") from None
    if not isinstance(body, dict):
        raise invalid("the body must be a JSON object")
    if problem := json_depth_problem(body, "body"):
        raise invalid(problem)
    if (model := DROPPED.get(path)) is not None:
        try:
            model.model_validate(body)
        except ValidationError as exc:
            raise from_validation(exc) from None
    return body
