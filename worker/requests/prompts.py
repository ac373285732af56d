"""Turn a request into prompt token ids: raw text as is, chat messages through the model's template.

Both producers and tests call this, so "the same request" means the same tokens everywhere.
Tools and `chat_template_kwargs` go to the template as mlx-lm's server hands them over; for a template
that declares no tool calling, kvrq writes the tools, calls and results into the messages
(worker/requests/tool_format.py).
"""

from __future__ import annotations

from typing import Any

from producer.models import GenerationRequest
from worker.requests.tool_format import native_tool_calling, tool_dicts, tools_rendered, written_into_messages


class PromptError(ValueError):
    """The request cannot be rendered for this model (e.g. no chat template)."""


def prompt_tokens(tokenizer: Any, request: GenerationRequest) -> list[int]:
    if request.messages is not None:
        messages = [m.template_dict() for m in request.messages]
        options: dict[str, Any] = dict(request.chat_template_kwargs or {})
        tools = tool_dicts(request) if tools_rendered(request) else None
        if native_tool_calling(tokenizer):
            if tools:
                options["tools"] = tools
        elif tools or any(m.role == "tool" or m.tool_calls for m in request.messages):
            messages = written_into_messages(messages, tools)  # the template knows no tools: kvrq's format
        try:
            rendered = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, **options
            )
        except Exception as exc:  # templates raise anything (jinja errors, role checks)
            raise PromptError(f"chat template failed: {exc}") from exc
        return _ids(rendered)
    assert request.prompt is not None
    return [int(t) for t in tokenizer.encode(request.prompt)]


def _ids(rendered: Any) -> list[int]:
    # transformers returns a list of ids, or a BatchEncoding / dict with input_ids, by version.
    if isinstance(rendered, dict) or hasattr(rendered, "input_ids"):
        rendered = rendered["input_ids"]
    if rendered and isinstance(rendered[0], list):
        rendered = rendered[0]
    return [int(t) for t in rendered]
