"""Anthropic's `context_management` edits, applied to a Messages body's messages before they are
rendered, as Anthropic documents them (context-management-2025-06-27):

- `clear_thinking_20251015` drops the thinking blocks of all but the last `keep` assistant turns that
  have some (`{"type": "thinking_turns", "value": N}`; default 1; `"all"` keeps every one).
- `clear_tool_uses_20250919`, once the context passes its `trigger` (`input_tokens`, default 100,000,
  or `tool_uses`), replaces the results of the oldest tool uses with a placeholder, keeping the last
  `keep` (default 3) and any in `exclude_tools`; `clear_tool_inputs` clears those calls' inputs too;
  nothing is cleared when less than `clear_at_least` tokens would go.

The producer has no tokenizer, so input tokens are estimated as characters / 4 (CHARS_PER_TOKEN).
An edit rewrites the messages from the first block it clears on, so the agent's cache is resumed up to
there and the rest prefilled; later turns that carry the same edit resume all of it.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from producer.http.errors import invalid

CLEAR_THINKING = "clear_thinking_20251015"
CLEAR_TOOL_USES = "clear_tool_uses_20250919"
#: What a cleared tool result (or input) holds instead.
CLEARED = "[cleared by context management]"
CHARS_PER_TOKEN = 4
DEFAULT_TRIGGER_TOKENS = 100_000
DEFAULT_KEEP_TOOL_USES = 3


def apply_edits(config: Any, messages: list[Any], rest_chars: int) -> tuple[list[Any], list[dict[str, Any]]]:
    """`messages` with the edits of `config` (a context_management object) applied, and the edits that
    changed something as Anthropic reports them (`applied_edits`). `rest_chars`: the size of the rest of
    the prompt (system, tools), counted in the input-token trigger. APIError 400 when malformed."""
    if not isinstance(config, dict) or not isinstance(config.get("edits", []), list):
        raise invalid("'context_management' is {edits: [...]}")
    if not all(isinstance(message, dict) for message in messages):
        return messages, []  # the messages' own check answers 400 for them
    applied: list[dict[str, Any]] = []
    for index, edit in enumerate(config.get("edits", [])):
        kind = edit.get("type") if isinstance(edit, dict) else None
        if kind == CLEAR_THINKING:
            messages, report = _clear_thinking(messages, edit.get("keep"))
        elif kind == CLEAR_TOOL_USES:
            messages, report = _clear_tool_uses(messages, edit, rest_chars)
        else:
            raise invalid(
                f"context_management.edits[{index}]: type {kind!r} is not one kvrq knows "
                f"(it applies {CLEAR_THINKING} and {CLEAR_TOOL_USES})"
            )
        if report is not None:
            applied.append(report)
    return messages, applied


def _clear_thinking(messages: list[Any], keep: Any) -> tuple[list[Any], dict[str, Any] | None]:
    if keep == "all":
        return messages, None
    turns = 1 if keep is None else _count(keep, "thinking_turns", "clear_thinking keep")
    thinking_turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant" and _thinking(m)]
    cleared = thinking_turns[: max(0, len(thinking_turns) - turns)]
    if not cleared:
        return messages, None
    out = list(messages)
    tokens = 0
    for i in cleared:
        kept = [b for b in out[i]["content"] if not _is_thinking(b)]
        tokens += _tokens([b for b in out[i]["content"] if _is_thinking(b)])
        out[i] = {**out[i], "content": kept or ""}
    report = {"type": CLEAR_THINKING, "cleared_thinking_turns": len(cleared), "cleared_input_tokens": tokens}
    return out, report


def _clear_tool_uses(
    messages: list[Any], edit: dict[str, Any], rest_chars: int
) -> tuple[list[Any], dict[str, Any] | None]:
    uses = [
        (i, j) for i, m in enumerate(messages) for j, b in enumerate(_blocks(m)) if _kind(b) == "tool_use"
    ]
    trigger = edit.get("trigger") or {"type": "input_tokens", "value": DEFAULT_TRIGGER_TOKENS}
    kind = trigger.get("type") if isinstance(trigger, dict) else None
    if kind not in ("input_tokens", "tool_uses"):
        raise invalid("clear_tool_uses trigger is {type: input_tokens | tool_uses, value: N}")
    limit = _count(trigger, kind, "clear_tool_uses trigger")
    size = len(uses) if kind == "tool_uses" else (_chars(messages) + rest_chars) // CHARS_PER_TOKEN
    if size <= limit:
        return messages, None
    keep = _count(
        edit.get("keep") or {"type": "tool_uses", "value": DEFAULT_KEEP_TOOL_USES},
        "tool_uses",
        "clear_tool_uses keep",
    )
    names = edit.get("exclude_tools") or []
    if not isinstance(names, list):
        raise invalid("clear_tool_uses exclude_tools is a list of tool names")
    excluded = {str(name) for name in names}
    inputs = bool(edit.get("clear_tool_inputs"))
    candidates = [_blocks(messages[i])[j] for i, j in uses]
    candidates = [block for block in candidates if str(block.get("name")) not in excluded]
    cleared_ids = {_id(block, "id") for block in candidates[: max(0, len(candidates) - keep)]} - {None}
    if not cleared_ids:
        return messages, None
    out = copy.deepcopy(messages)
    tokens = 0
    for message in out:
        for block in _blocks(message):
            if _kind(block) == "tool_result" and _id(block, "tool_use_id") in cleared_ids:
                tokens += _tokens(block.get("content"))
                block["content"] = CLEARED
            elif inputs and _kind(block) == "tool_use" and _id(block, "id") in cleared_ids:
                tokens += _tokens(block.get("input"))
                block["input"] = {}
    at_least = edit.get("clear_at_least")
    if at_least is not None and tokens < _count(at_least, "input_tokens", "clear_tool_uses clear_at_least"):
        return messages, None
    report = {"type": CLEAR_TOOL_USES, "cleared_tool_uses": len(cleared_ids), "cleared_input_tokens": tokens}
    return out, report


def _count(value: Any, kind: str, where: str) -> int:
    if not isinstance(value, dict) or value.get("type") != kind or not isinstance(value.get("value"), int):
        raise invalid(f"context_management: {where} is {{type: {kind}, value: N}}")
    return max(0, int(value["value"]))


def _blocks(message: Any) -> list[Any]:
    content = message.get("content") if isinstance(message, dict) else None
    return content if isinstance(content, list) else []


def _id(block: dict[str, Any], key: str) -> str | None:
    """A block's id (`id`, `tool_use_id`) when it is a string, as ids are."""
    value = block.get(key)
    return value if isinstance(value, str) else None


def _kind(block: Any) -> Any:
    return block.get("type") if isinstance(block, dict) else None


def _is_thinking(block: Any) -> bool:
    return _kind(block) in ("thinking", "redacted_thinking")


def _thinking(message: dict[str, Any]) -> bool:
    return any(_is_thinking(block) for block in _blocks(message))


def _chars(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False))


def _tokens(value: Any) -> int:
    return 0 if value is None else _chars(value) // CHARS_PER_TOKEN
