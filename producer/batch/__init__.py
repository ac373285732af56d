"""Batch offline generation runs, the Python API: `run_batch`, `batch_status`, `cancel_batch`, `list_batches`.

The CLI (`kvrq batch run|status|cancel`, producer/batch/cli.py) is a thin layer over these.

Input: JSONL in the OpenAI Batch API request format, one request per line:
    {"custom_id": "t1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "any", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 64},
     "kvrq": {"agent_id": "a1"}}
- `url` is /v1/chat/completions (body.messages) or /v1/completions (body.prompt, one string).
- body fields used: messages / prompt, max_tokens (max_completion_tokens wins), temperature, top_p, seed,
  stop, top_k, min_p, repetition_penalty, repetition_context_size, presence_penalty, frequency_penalty,
  logit_bias; chat also logprobs, top_logprobs, tools, tool_choice, parallel_tool_calls, response_format,
  chat_template_kwargs and messages with tool_calls / tool_call_id (/v1/completions: logprobs is the top
  count, 0 to 5); `model`, `user`, `store`, `metadata`, `service_tier` are accepted and ignored. Fields kvrq
  cannot honour (n, best_of, stream, echo, suffix) are accepted only at their neutral value; anything else
  is an error line. Defaults are OpenAI's (temperature 1, top_p 1; 16 max_tokens for /v1/completions), because
  the file was written for that API; chat without max_tokens gets kvrq's default (256).
- `kvrq.agent_id` (optional, the only kvrq extension, outside `body` so the body stays OpenAI's): the
  line resumes that agent's KV cache and saves it back. An agent's lines run one at a time in file order
  (turn 2 starts after turn 1 ended, from its cache); other lines and other agents run concurrently.

Output: one JSONL line per non-blank input line, in completion order, each custom_id exactly once:
    {"id": "batch_req_<job>", "custom_id": "t1", "error": null,
     "response": {"status_code": 200, "request_id": "<job id>", "body": <chat.completion | text_completion>},
     "kvrq": {"line": 1, "agent_id": "a1", "job_id": "...", "usage": {...}, "timings": {...}, "worker": ".."}}
  The chat.completion message carries `tool_calls` (content null when the answer is calls alone) and
  `reasoning` where the model gave them; `choices[0].logprobs` is OpenAI's shape when asked for.
  `body.usage` has prompt_tokens, completion_tokens, total_tokens and prompt_tokens_details.cached_tokens
  (prompt tokens reused from the agent's cache). A line that produced nothing has `"response": null` and
  `"error": {"code", "message"}`; codes: invalid_json, invalid_request, unsupported_url,
  duplicate_custom_id (the later line; custom_id null), and for jobs that ran, from the ErrorCode the
  worker recorded: invalid_request, context_length_exceeded, job_timeout, worker_crashed, job_failed
  (engine or internal errors); then job_canceled, job_lost (vanished from Redis). Lines with no usable
  custom_id report `"custom_id": null` and `kvrq.line`.

Runs: the run id defaults to a hash of the input bytes and the queue, so running the same input again
resumes the same run: lines already in the output are skipped, jobs a previous client enqueued (rq job
id = run id + custom_id) are waited for, never enqueued twice. Each line is appended and fsynced as soon
as it ends, so Ctrl-C or a crash loses nothing. At most `concurrency` jobs of the run are queued or
running at once (default: the sum of the `kvrq_capacity` the live workers of the queue advertise in
their rq worker hash, 2 x --max-batch each; 16 when none does). `cancel_batch` cancels the queued jobs
and stops the driving client; running the input again afterwards resumes the run. Run records live in
Redis under `kvrq:batch:run:<id>` and expire 7 days after the run is done or canceled.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from redis import Redis

from producer.batch.driver import BatchSummary, run_batch
from producer.batch.jobs import LOOKUP_CHUNK, RqJobSource, chunks
from producer.batch.run import BatchRun, list_runs

__all__ = ["BatchSummary", "RunNotFoundError", "batch_status", "cancel_batch", "list_batches", "run_batch"]


class RunNotFoundError(LookupError):
    """No batch run of that id is recorded in this Redis (never started, or expired)."""


def batch_status(connection: Redis, run_id: str) -> dict[str, Any]:
    """The run record plus a live tally of its rq jobs (right even when no client is driving the run)."""
    run = BatchRun(connection, run_id)
    info = run.info()
    if info is None:
        raise RunNotFoundError(f"no batch run {run_id!r} in this Redis")
    status = info.to_dict()
    job_ids = sorted(run.job_ids())
    jobs = RqJobSource(connection, info.queue or "kvrq")
    tally: Counter[str] = Counter()
    for chunk in chunks(job_ids, LOOKUP_CHUNK):
        tally.update(o.state for o in jobs.lookup(chunk).values())
    status["jobs_by_state"] = dict(sorted(tally.items()))
    heartbeat = status.get("heartbeat_at")
    if heartbeat:
        status["heartbeat_age_s"] = round(time.time() - float(heartbeat), 1)
    return status


def cancel_batch(connection: Redis, run_id: str, *, running: bool = False) -> int:
    """Mark the run canceled and cancel its queued jobs (running ones too with `running`).

    Returns how many jobs were canceled. A client driving the run notices and stops; running
    `run_batch` again on the same input resumes the run and enqueues the canceled lines afresh.
    """
    run = BatchRun(connection, run_id)
    info = run.info()
    if info is None:
        raise RunNotFoundError(f"no batch run {run_id!r} in this Redis")
    run.mark_canceled()  # first: a driver enqueuing right now sees it and cancels its own new jobs
    job_ids = sorted(run.job_ids())
    jobs = RqJobSource(connection, info.queue or "kvrq")
    return sum(jobs.cancel(chunk, running=running) for chunk in chunks(job_ids, LOOKUP_CHUNK))


def list_batches(connection: Redis, limit: int = 20) -> list[dict[str, Any]]:
    """The most recent runs recorded in this Redis, newest first."""
    return [info.to_dict() for info in list_runs(connection, limit)]
