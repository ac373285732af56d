"""Turn a request into prompt token ids: raw text as is, chat messages through the model's template.

Both producers and tests call this, so "the same request" means the same tokens everywhere.
Tools and `chat_template_kwargs` go to the template as mlx-lm's server hands them over.
"""

from __future__ import annotations

from typing import Any

from producer.models import GenerationRequest
from worker.agent_output import tool_dicts, tools_rendered


class PromptError(ValueError):
    """The request cannot be rendered for this model (e.g. no chat template)."""


def prompt_tokens(tokenizer: Any, request: GenerationRequest) -> list[int]:
    if request.messages is not None:
        messages = [m.template_dict() for m in request.messages]
        options: dict[str, Any] = dict(request.chat_template_kwargs or {})
        if tools_rendered(request):
            if not getattr(tokenizer, "has_tool_calling", False):
                raise PromptError(
                    "this model's chat template declares no tool calling (mlx-lm finds no tool-call "
                    "format in it), so tool calls could not be told from text: send the request without "
                    "tools, or use a model whose template supports them"
                )
            options["tools"] = tool_dicts(request)
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
