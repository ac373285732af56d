"""kvrq's producer side: enqueue generation jobs into rq and follow them. Needs only redis, rq, pydantic."""

from producer.client import (
    JobCanceledError,
    JobFailedError,
    JobHandle,
    JobNotFoundError,
    Producer,
    ResultTimeoutError,
)
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
from producer.protocol import DEFAULT_QUEUE, JOB_FUNCTION

__all__ = [
    "DEFAULT_QUEUE",
    "JOB_FUNCTION",
    "ChatMessage",
    "GenerationRequest",
    "GenerationResult",
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
