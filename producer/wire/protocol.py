"""The wire contract between producers and workers: names, Redis keys and stream events.

Both sides import this module (the worker depends on the producer, never the reverse), so
a key or field renamed here changes for both at once.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast

from producer.wire.text import as_text

#: The function path rq records for every kvrq job. Plain rq users enqueue this string.
JOB_FUNCTION = "worker.jobs.generate"
DEFAULT_QUEUE = "kvrq"
#: rq serializer alias used for every kvrq job: JSON, never pickle.
SERIALIZER = "json"

#: Field kvrq adds to its rq worker hash: jobs the worker holds at once (batch runs size their
#: concurrency from it).
CAPACITY_FIELD = "kvrq_capacity"
#: The other fields kvrq adds to its rq worker hash (what `kvrq status` shows): the model, jobs running
#: in the engine and waiting for admission, and the KV block pool's size and free blocks.
MODEL_FIELD = "kvrq_model"
#: The model's context length in tokens (prompt and answer together): kvrq serve's /v1/models carries it.
CONTEXT_FIELD = "kvrq_context"
MAX_BATCH_FIELD = "kvrq_max_batch"
RUNNING_FIELD = "kvrq_running"
WAITING_FIELD = "kvrq_waiting"
POOL_BLOCKS_FIELD = "kvrq_pool_blocks"
FREE_BLOCKS_FIELD = "kvrq_free_blocks"
#: Cache figures since the worker started: agents in its hot tier, cache lookups, hits in the hot
#: tier, hits in all (hot tier or store), prompt tokens seen and prompt tokens reused from caches.
HOT_AGENTS_FIELD = "kvrq_hot_agents"
CACHE_LOOKUPS_FIELD = "kvrq_cache_lookups"
HOT_HITS_FIELD = "kvrq_hot_hits"
CACHE_HITS_FIELD = "kvrq_cache_hits"
PROMPT_TOKENS_FIELD = "kvrq_prompt_tokens"
REUSED_TOKENS_FIELD = "kvrq_reused_tokens"
#: JSON object of MB by kind: the worker's resident set and what its engine and store hold
#: (worker/fleet/memory.py).
MEMORY_FIELD = "kvrq_memory_mb"
#: JSON object of the worker's per-job latency histograms since it started (worker/fleet/latency.py):
#: {name: {"bounds": [upper bounds], "counts": [jobs per bucket, the last one +Inf]}}.
LATENCY_FIELD = "kvrq_latency"
#: job.meta key of a failed job's structured error: {"code": ErrorCode value, "message": one line}.
#: Clients and batch runs decide on `code`, never on the text of rq's exc_info.
ERROR_META_KEY = "kvrq_error"


class ErrorCode:
    """Why a kvrq job failed; the values are the wire format (job.meta[ERROR_META_KEY]["code"])."""

    INVALID_REQUEST = "invalid_request"  # the payload can never run (bad fields, too large): not retried
    #: An invalid request of one kind: prompt + max_tokens exceed the model context or the whole block pool.
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    TIMEOUT = "timeout"  # the job ran past its job_timeout
    ENGINE_ERROR = "engine_error"  # the model step or the engine failed while the job ran
    WORKER_CRASHED = "worker_crashed"  # its workers died while holding it, past its crash budget
    INTERNAL = "internal"  # anything else the worker did not expect

    ALL = (INVALID_REQUEST, CONTEXT_LENGTH_EXCEEDED, TIMEOUT, ENGINE_ERROR, WORKER_CRASHED, INTERNAL)


def failure_of(meta: Mapping[str, Any] | None, exc_string: str | None) -> tuple[str, str]:
    """(ErrorCode value, one-line message) of a failed job, read from its job.meta and rq's exc_string.

    A kvrq worker records the code in job.meta[ERROR_META_KEY]. Jobs it could not record anything
    for were failed by rq itself: rq's abandoned-job cleanup (a worker died holding the job) writes no
    meta, only an exc_string naming AbandonedJobError, so this is the one place that reads rq's text.
    """
    error = (meta or {}).get(ERROR_META_KEY)
    if isinstance(error, Mapping) and isinstance(error.get("code"), str) and error["code"]:
        message = error.get("message")
        return error["code"], message if isinstance(message, str) and message else last_line(exc_string)
    message = last_line(exc_string)
    if "AbandonedJobError" in (exc_string or ""):
        return ErrorCode.WORKER_CRASHED, f"its worker died while running it (rq: {message})"
    return ErrorCode.INTERNAL, message


def last_line(exc_string: str | None) -> str:
    """The last non-empty line of an rq exc_string: the exception and its message."""
    lines = [line.strip() for line in (exc_string or "").strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no reason recorded"


_PREFIX = "kvrq"


def stream_key(job_id: str) -> str:
    """Redis stream carrying one job's token deltas and its end marker."""
    return f"{_PREFIX}:stream:{job_id}"


def cancel_key(job_id: str) -> str:
    """Flag set by a producer to cancel a job the worker may already hold."""
    return f"{_PREFIX}:cancel:{job_id}"


def agent_lock_key(agent_id: str) -> str:
    """Lock that keeps two jobs of one agent from running at once, across workers."""
    return f"{_PREFIX}:agent-lock:{agent_id}"


def batch_run_key(run_id: str) -> str:
    """Hash of one batch run: state, counts, queue, paths, timestamps, the driving client."""
    return f"{_PREFIX}:batch:run:{run_id}"


def batch_jobs_key(run_id: str) -> str:
    """Set of the rq job ids one batch run enqueued."""
    return f"{batch_run_key(run_id)}:jobs"


#: Sorted set of batch run ids by creation time (`kvrq batch status` lists it).
BATCH_RUNS_KEY = f"{_PREFIX}:batch:runs"


CANCEL_FLAG_TTL_S = 24 * 3600

EventKind = Literal["start", "delta", "reasoning", "tool_call", "logprobs", "end", "error"]


@dataclass(frozen=True)
class _Codec:
    """How one StreamEvent attribute travels as a stream field: `write` gives None to leave it out."""

    write: Callable[[Any], str | None]
    read: Callable[[str | None], Any]


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _token(token: int) -> int | None:
    return None if token < 0 else token


_TEXT = _Codec(lambda v: v or "", lambda raw: raw or "")
_OPTIONAL_TEXT = _Codec(lambda v: v or "", lambda raw: raw or None)  # "" on the wire is None
_TEXT_IF_SET = _Codec(lambda v: v, lambda raw: raw or None)  # absent for None (older readers)
_TOKEN = _Codec(lambda v: str(-1 if v is None else v), lambda raw: _token(int(raw or -1)))  # -1 is None
_JSON = _Codec(_json, lambda raw: json.loads(raw or "{}"))
_JSON_IF_SET = _Codec(
    lambda v: None if v is None else _json(v), lambda raw: None if raw is None else json.loads(raw)
)

#: Each event kind's stream fields besides "e" (the kind): (StreamEvent attribute, field, codec).
_LAYOUT: dict[str, tuple[tuple[str, str, _Codec], ...]] = {
    "start": (("attempt", "attempt", _OPTIONAL_TEXT),),
    "delta": (("text", "t", _TEXT), ("token", "tok", _TOKEN)),
    "reasoning": (("text", "t", _TEXT),),
    "tool_call": (("data", "data", _JSON),),
    "logprobs": (("data", "data", _JSON),),
    "end": (("finish_reason", "reason", _OPTIONAL_TEXT), ("data", "data", _JSON_IF_SET)),
    "error": (("error", "error", _TEXT), ("code", "code", _TEXT_IF_SET)),
}


@dataclass(frozen=True)
class StreamEvent:
    """One entry of a job's stream.

    `start`: a worker began (or, after a crash or drain, began again) an `attempt` of the job;
    `delta`: answer `text` (empty while a character is incomplete, for the stop token, and for tokens
    of reasoning or a tool call) and `token`; `reasoning`: thinking `text`, apart from the answer;
    `tool_call`: one parsed call as `data` (OpenAI's {"id", "type", "function": {"name", "arguments"}});
    `logprobs`: one generated token's `data` ({"token", "token_id", "logprob", "bytes", "top_logprobs"}),
    for requests that asked; `end`: `finish_reason` ("stop", "length", "tool_calls" or "canceled"),
    and for a finished job `data` {"usage": the result's usage}; `error`: `error` (the reason) and, for
    a job that failed for good, `code` (ErrorCode). A job's ending is one event that carries what a
    stream reader needs of its result; an older worker's `end` has no `data`, its `error` no `code`.
    """

    kind: EventKind
    text: str = ""
    token: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    attempt: str | None = None
    data: dict[str, Any] | None = None
    code: str | None = None

    def to_fields(self) -> dict[str, str]:
        fields: dict[str, str] = {"e": self.kind}
        for attribute, field, codec in _LAYOUT[self.kind]:
            value = codec.write(getattr(self, attribute))
            if value is not None:
                fields[field] = value
        return fields

    @classmethod
    def from_fields(cls, fields: dict[bytes, bytes] | dict[str, str]) -> StreamEvent:
        data = {as_text(k): as_text(v) for k, v in fields.items()}
        kind = data.get("e", "")
        if kind not in _LAYOUT:
            raise ValueError(f"unknown stream event {data!r}")
        values = {attribute: codec.read(data.get(field)) for attribute, field, codec in _LAYOUT[kind]}
        return cls(cast(EventKind, kind), **values)

    @property
    def final(self) -> bool:
        return self.kind in ("end", "error")


# ---- keys of the worker fleet (workers write them; `kvrq status` and maintenance read them) ----


def agent_jobs_key(agent_id: str) -> str:
    """Sorted set of an agent's jobs held by any worker, scored by first enqueue time: whose turn it is."""
    return f"{_PREFIX}:agent-jobs:{agent_id}"


def agent_conversation_key(agent_id: str) -> str:
    """The agent's conversation record as of its last finished turn (producer/conversation.py)."""
    return f"{_PREFIX}:agent-conversation:{agent_id}"


def agent_fence_key(agent_id: str) -> str:
    """Counter bumped each time a job takes its agent's turn: the fencing token of that job's cache put."""
    return f"{_PREFIX}:agent-fence:{agent_id}"


def worker_alive_key(worker_name: str) -> str:
    """Short-lived key a live worker keeps refreshing from a thread of its own: gone = the worker died."""
    return f"{_PREFIX}:worker-alive:{worker_name}"


def worker_agents_key(worker_name: str) -> str:
    """Set of the agents whose turn (agent lock) a worker holds, freed at once when it dies."""
    return f"{_PREFIX}:worker-agents:{worker_name}"


#: job.meta keys kvrq writes: the first enqueue time (an agent's order survives re-queues) and the
#: crash re-runs used and allowed (a per-job budget; the worker's setting when absent).
FIRST_ENQUEUED_META_KEY = "kvrq_first_enqueued_at"
CRASHES_META_KEY = "kvrq_crashes"
CRASH_BUDGET_META_KEY = "kvrq_crash_reruns"


# ---- agent affinity: an agent's next job goes to the worker that holds its cache hot -------------

#: Separates a shared queue's name from a worker's name in that worker's own queue ("kvrq~<worker>").
#: Producers never accept it in a queue name (QUEUE_NAME_PATTERN), so the split is unambiguous.
WORKER_QUEUE_SEPARATOR = "~"
#: Seconds an agent -> worker record lives after the agent's last job on that worker.
AGENT_HOME_TTL_S = 3600


def worker_queue_name(queue: str, worker_name: str) -> str:
    """The queue a worker drains before `queue`: jobs of agents whose cache it holds hot."""
    return f"{queue}{WORKER_QUEUE_SEPARATOR}{worker_name}"


def shared_queue_of(queue: str) -> str:
    """The shared queue behind a worker's own queue (a shared queue is its own)."""
    return queue.split(WORKER_QUEUE_SEPARATOR, 1)[0]


def agent_home_key(agent_id: str) -> str:
    """Name of the worker whose hot tier holds the agent's newest cache."""
    return f"{_PREFIX}:agent-home:{agent_id}"


# ---- kvrq serve's Responses API state (producer/http/conversations.py) ----------------------------


def response_key(response_id: str) -> str:
    """JSON record of one stored /v1/responses response: its owner, agent, Response object, items."""
    return f"{_PREFIX}:response:{response_id}"


def conversation_key(conversation_id: str) -> str:
    """JSON record of one /v1/conversations conversation: its owner, agent, metadata."""
    return f"{_PREFIX}:conversation:{conversation_id}"


def conversation_items_key(conversation_id: str) -> str:
    """List of a conversation's items (JSON), oldest first."""
    return f"{conversation_key(conversation_id)}:items"
