"""kvrq's producer side: enqueue generation jobs into rq and follow them, blocking (Producer) or with
asyncio (AsyncProducer). Needs only redis, rq, pydantic.

The names below load on first use, so `producer.wire` (the contract `store/` imports too) stays free
of rq and pydantic.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from producer.aio import AsyncJobHandle, AsyncProducer
    from producer.client import JobHandle, Producer
    from producer.errors import JobCanceledError, JobFailedError, JobNotFoundError, ResultTimeoutError
    from producer.models import (
        ChatMessage,
        GenerationRequest,
        GenerationResult,
        Timings,
        TokenLogprob,
        Tool,
        ToolCall,
        Usage,
    )
    from producer.wire.protocol import DEFAULT_QUEUE, JOB_FUNCTION

_HOMES = {
    "producer.aio": ("AsyncJobHandle", "AsyncProducer"),
    "producer.client": ("JobHandle", "Producer"),
    "producer.errors": ("JobCanceledError", "JobFailedError", "JobNotFoundError", "ResultTimeoutError"),
    "producer.models": (
        "ChatMessage",
        "GenerationRequest",
        "GenerationResult",
        "Timings",
        "TokenLogprob",
        "Tool",
        "ToolCall",
        "Usage",
    ),
    "producer.wire.protocol": ("DEFAULT_QUEUE", "JOB_FUNCTION"),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}

__all__ = [
    "AsyncJobHandle",
    "AsyncProducer",
    "ChatMessage",
    "DEFAULT_QUEUE",
    "GenerationRequest",
    "GenerationResult",
    "JOB_FUNCTION",
    "JobCanceledError",
    "JobFailedError",
    "JobHandle",
    "JobNotFoundError",
    "Producer",
    "ResultTimeoutError",
    "Timings",
    "TokenLogprob",
    "Tool",
    "ToolCall",
    "Usage",
]


def __getattr__(name: str) -> Any:
    module = _HOME_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'producer' has no attribute {name!r}")
    return getattr(import_module(module), name)
