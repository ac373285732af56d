"""Turn a request into prompt token ids: raw text as is, chat messages through the model's template.

Both producers and tests call this, so "the same request" means the same tokens everywhere.
"""

from __future__ import annotations

from typing import Any

from producer.models import GenerationRequest


class PromptError(ValueError):
    """The request cannot be rendered for this model (e.g. no chat template)."""


def prompt_tokens(tokenizer: Any, request: GenerationRequest) -> list[int]:
    if request.messages is not None:
        messages = [{"role": m.role, "content": m.content} for m in request.messages]
        try:
            rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
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
