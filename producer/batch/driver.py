"""`run_batch`: drive one batch run from a JSONL file to a JSONL file through kvrq workers.

The driver is resumable because every decision is recomputed from durable state: the output file says
which lines are finished, deterministic job ids (run id + custom_id) find the jobs a previous client
enqueued, and the run record in Redis carries state and counts for `kvrq batch status`. It keeps at most
`concurrency` jobs of the run queued or running (backpressure) and enqueues an agent's next line only after
its previous line ended.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from redis import Redis

from producer.batch.format import (
    BadLine,
    BatchRequest,
    LineErrorCode,
    bad_line_output,
    error_line,
    failed_job_code,
    parse_lines,
)
from producer.batch.format import success_line as format_success
from producer.batch.jobs import LOOKUP_CHUNK, JobOutcome, JobSource, RqJobSource, chunks
from producer.batch.lanes import Lanes
from producer.batch.output import BatchOutput
from producer.batch.progress import Progress
from producer.batch.run import BatchRun, RunState, derive_run_id, job_id_for, validate_run_id
from producer.liveness import WorkerWatch, live_workers
from producer.tenants import Tenant
from producer.wire.protocol import CAPACITY_FIELD, DEFAULT_QUEUE
from producer.wire.redis_url import connect

logger = logging.getLogger("kvrq.batch")

DEFAULT_CONCURRENCY = 16
#: Results of a batch job outlive a crashed client this long, so a rerun picks them up instead of re-running.
RESULT_TTL_S = 24 * 3600
#: Once its line is in the output file a job is only needed by a concurrent reader: keep it this long.
RETIRED_TTL_S = 600
#: rq retries of a batch job: a worker that dies mid-job (abandoned job) does not turn the line into an error.
#: The worker never retries a request it rejected as invalid.
JOB_RETRIES = 2
MAX_RESUBMITS = 2  # a job that vanished from Redis (flushed, expired) is enqueued again this often
STATE_EVERY_S = 1.0  # run record and cancel check at most this often


@dataclass(frozen=True)
class BatchSummary:
    """What one `run_batch` call did; counts cover the whole input, not only this call."""

    run_id: str
    state: str  # "done" or "canceled"
    total: int  # non-blank input lines
    done: int  # lines with a response in the output
    failed: int  # lines with an error in the output (bad input included)
    invalid: int  # bad input lines (never reached a worker)
    skipped: int  # lines already in the output when this call started
    submitted: int  # jobs this call enqueued
    reattached: int  # jobs a previous client had enqueued, picked up by this call
    generated_tokens: int  # by the lines this call collected
    wall_s: float
    output: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def default_concurrency(connection: Redis, queue: str) -> int:
    """What the live workers of `queue` say they hold at once (DEFAULT_CONCURRENCY for a silent one)."""
    try:
        workers = live_workers(connection, queue)
    except ValueError:  # a worker hash this rq cannot read: fall back to the default
        return DEFAULT_CONCURRENCY
    total = 0
    for worker in workers:
        raw = connection.hget(worker.key, CAPACITY_FIELD)
        try:
            total += int(raw) if raw is not None else DEFAULT_CONCURRENCY
        except ValueError:
            total += DEFAULT_CONCURRENCY
    return total if total > 0 else DEFAULT_CONCURRENCY


def read_input(path: str | os.PathLike[str]) -> tuple[bytes, list[BatchRequest | BadLine]]:
    data = Path(path).read_bytes()
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    return data, parse_lines(data.split(b"\n"))


def run_batch(
    input_path: str | os.PathLike[str],
    output_path: str | os.PathLike[str],
    *,
    redis_url: str | None = None,
    queue: str = DEFAULT_QUEUE,
    concurrency: int | None = None,
    run_id: str | None = None,
    connection: Redis | None = None,
    jobs: JobSource | None = None,
    progress: bool | None = None,
    log: Callable[[str], None] | None = None,
    log_interval_s: float = 10.0,
    poll_interval_s: float = 0.5,
    tenant: str | None = None,
) -> BatchSummary:
    """Run every line of `input_path` (OpenAI Batch JSONL) and append one result line each to `output_path`.

    Call it again with the same files to resume. `progress`: True for a tqdm bar, False for log lines
    (through `log`, default the `kvrq.batch` logger), None for a bar only when stderr is a TTY.
    `tenant`: the lines' agents and prefix reuse are that tenant's (producer/tenants.py).
    """
    started = time.monotonic()
    data, items = read_input(input_path)
    if run_id is None:
        run_id = derive_run_id(data, queue, tenant)
    validate_run_id(run_id)
    if tenant is not None:
        items = tenant_lines(items, Tenant(tenant))
    if concurrency is not None and concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    output = BatchOutput(output_path).open()
    try:
        if not items:
            return BatchSummary(
                run_id, "done", 0, 0, 0, 0, 0, 0, 0, 0, time.monotonic() - started, str(output_path)
            )
        if connection is None:
            if redis_url is None:
                raise ValueError("give redis_url or connection")
            connection = connect(redis_url)
        if concurrency is None:
            concurrency = default_concurrency(connection, queue)
        driver = BatchDriver(
            items,
            output,
            BatchRun(connection, run_id),
            jobs if jobs is not None else RqJobSource(connection, queue, tenant=tenant),
            queue=queue,
            concurrency=concurrency,
            input_path=str(input_path),
            progress=progress,
            log=log or logger.info,
            log_interval_s=log_interval_s,
            poll_interval_s=poll_interval_s,
            connection=connection,
        )
        return driver.run(started)
    finally:
        output.close()


def tenant_lines(items: list[BatchRequest | BadLine], tenant: Tenant) -> list[BatchRequest | BadLine]:
    """The lines as `tenant`'s: a line whose agent id cannot be the tenant's (too long to qualify)
    becomes an error line, not a failed run."""
    out: list[BatchRequest | BadLine] = []
    for item in items:
        if isinstance(item, BatchRequest) and item.agent_id is not None:
            try:
                tenant.agent(item.agent_id)
            except ValueError as exc:
                item = BadLine(item.line, item.custom_id, "invalid_request", f"line {item.line}: {exc}")
        out.append(item)
    return out


class BatchDriver:
    """One client session of a run: write bad lines, re-attach old jobs, then enqueue and collect."""

    def __init__(
        self,
        items: list[BatchRequest | BadLine],
        output: BatchOutput,
        run: BatchRun,
        jobs: JobSource,
        *,
        queue: str,
        concurrency: int,
        input_path: str,
        progress: bool | None,
        log: Callable[[str], None],
        log_interval_s: float,
        poll_interval_s: float,
        connection: Redis | None = None,
    ) -> None:
        """`connection`: where to look for live workers, to say when none listens on `queue`."""
        self.items = items
        self.output = output
        self.run_record = run
        self.run_id = run.run_id
        self.jobs = jobs
        self.queue = queue
        self.concurrency = concurrency
        self.input_path = input_path
        self.log = log
        self.poll_interval_s = poll_interval_s
        self.lanes = Lanes()
        self.in_flight: dict[str, BatchRequest] = {}
        self.resubmits: dict[str, int] = {}
        self.submitted = 0
        self.reattached = 0
        self.invalid = sum(1 for item in items if isinstance(item, BadLine))
        self.skipped = sum(1 for item in items if item.key in output)
        self.canceled = False
        self.queued = 0
        self.running = 0
        self._last_state_at = 0.0
        self.progress = Progress(
            self.run_id,
            len(items),
            done=sum(1 for item in items if output.keys.get(item.key) is True),
            failed=sum(1 for item in items if output.keys.get(item.key) is False),
            bar=progress,
            write=log,
            interval_s=log_interval_s,
        )
        self.watch = None if connection is None else WorkerWatch(connection, queue, self._notice)

    # ---- the session ------------------------------------------------------------------------

    def run(self, started: float) -> BatchSummary:
        previous = self.run_record.start(
            queue=self.queue,
            total=len(self.items),
            input_path=self.input_path,
            output_path=str(self.output.path),
            concurrency=self.concurrency,
        )
        if previous == "canceled":
            self.log(f"batch {self.run_id}: run was canceled; resuming it")
        elif previous is not None and self.skipped:
            self.log(
                f"batch {self.run_id}: resuming, {self.skipped}/{len(self.items)} lines already in the output"
            )
        try:
            self._write_bad_lines()
            self._reattach(previous == "canceled")
            self._loop()
        except BaseException:
            self.progress.close()
            with contextlib.suppress(Exception):  # Redis may be what failed; the original error matters
                self._store_state(force=True)
            raise
        state: RunState = "canceled" if self.canceled else "done"
        self._store_state(force=True, state=state)
        self.progress.close()
        return BatchSummary(
            run_id=self.run_id,
            state=state,
            total=len(self.items),
            done=self.progress.done,
            failed=self.progress.failed,
            invalid=self.invalid,
            skipped=self.skipped,
            submitted=self.submitted,
            reattached=self.reattached,
            generated_tokens=self.progress.tokens,
            wall_s=time.monotonic() - started,
            output=str(self.output.path),
        )

    def _notice(self, text: str) -> None:
        self.progress.note(f"batch {self.run_id}: {text}")

    def _write_bad_lines(self) -> None:
        for item in self.items:
            if isinstance(item, BadLine) and item.key not in self.output:
                self.output.append(item.key, bad_line_output(self.run_id, item))
                self.progress.advance(False, ran=False)

    def _reattach(self, was_canceled: bool) -> None:
        """Jobs of unfinished lines that a previous client enqueued are waited for, not enqueued again."""
        pending = [
            item for item in self.items if isinstance(item, BatchRequest) and item.key not in self.output
        ]
        ids = [job_id_for(self.run_id, item.custom_id) for item in pending]
        outcomes: dict[str, JobOutcome] = {}
        for chunk in chunks(ids, LOOKUP_CHUNK):
            outcomes.update(self.jobs.lookup(chunk))
        dead = [job_id for job_id in ids if outcomes[job_id].state == "canceled"]
        if dead:
            # Canceled by `kvrq batch cancel` (or by hand): resuming the run means running them after all.
            self.jobs.discard(dead)
            if not was_canceled:
                self.log(f"batch {self.run_id}: {len(dead)} canceled job(s) will be enqueued again")
        for item, job_id in zip(pending, ids, strict=True):
            if outcomes[job_id].state in ("queued", "running", "finished", "failed"):
                self.in_flight[job_id] = item
                self.lanes.hold(item)
                self.reattached += 1
            else:
                self.lanes.add(item)
        self.lanes.start()
        if self.reattached:
            self.log(f"batch {self.run_id}: re-attached to {self.reattached} job(s) already enqueued")

    def _loop(self) -> None:
        while True:
            self._fill()
            if not self.in_flight:
                return
            outcomes = self.jobs.lookup(list(self.in_flight))
            if (
                any(o.state == "canceled" for o in outcomes.values())
                and self.run_record.state() == "canceled"
            ):
                self._stop_canceled()
                return
            ended = self._collect(outcomes)
            if self._store_state() == "canceled":
                self._stop_canceled()
                return
            self.progress.tick()
            if self.watch is not None:
                if ended:
                    self.watch.progressed()
                self.watch.check()
            if not ended and self.in_flight:
                self.jobs.wait(list(self.in_flight), self.poll_interval_s)

    def _fill(self) -> None:
        """Enqueue ready lines while fewer than `concurrency` jobs of the run are queued or running."""
        batch: list[tuple[str, BatchRequest]] = []
        while len(self.in_flight) + len(batch) < self.concurrency:
            item = self.lanes.pop_ready()
            if item is None:
                break
            batch.append((job_id_for(self.run_id, item.custom_id), item))
        if batch:
            self._submit(batch)

    def _submit(self, batch: list[tuple[str, BatchRequest]]) -> None:
        self.run_record.add_jobs([job_id for job_id, _ in batch])  # recorded before enqueued: cancel sees all
        self.jobs.submit([(job_id, self._request(item)) for job_id, item in batch])
        for job_id, item in batch:
            self.in_flight[job_id] = item
        self.submitted += len(batch)

    def _request(self, item: BatchRequest) -> dict[str, Any]:
        metadata = {**item.request.get("metadata", {}), "batch_run": self.run_id, "custom_id": item.custom_id}
        return {**item.request, "metadata": metadata, "result_ttl": RESULT_TTL_S, "retries": JOB_RETRIES}

    def _collect(self, outcomes: Mapping[str, JobOutcome]) -> int:
        """Write the lines whose jobs ended; returns how many ended."""
        ended: list[str] = []
        self.queued = sum(1 for o in outcomes.values() if o.state == "queued")
        self.running = sum(1 for o in outcomes.values() if o.state == "running")
        for job_id, outcome in outcomes.items():
            item = self.in_flight[job_id]
            if outcome.state == "finished":
                assert outcome.result is not None
                self.output.append(item.key, format_success(item, job_id, outcome.result))
                usage = outcome.result.get("usage") or {}
                self.progress.advance(True, int(usage.get("generated_tokens", 0)))
            elif outcome.state == "failed":
                message = outcome.error or "the job failed"
                self._write_error(item, job_id, failed_job_code(outcome.code), message)
            elif outcome.state == "canceled":
                self._write_error(item, job_id, "job_canceled", "the job was canceled")
            elif outcome.state == "missing":
                self._resubmit_or_give_up(item, job_id)
                continue
            else:
                continue
            ended.append(job_id)
        for job_id in ended:
            self.lanes.release(self.in_flight.pop(job_id))
        if ended:
            self.jobs.retire(ended, RETIRED_TTL_S)
        self.progress.set_in_flight(self.queued, self.running)
        return len(ended)

    def _write_error(self, item: BatchRequest, job_id: str, code: LineErrorCode, message: str) -> None:
        self.output.append(
            item.key, error_line(self.run_id, item.line, item.custom_id, code, message, job_id, item.agent_id)
        )
        self.progress.advance(False)

    def _resubmit_or_give_up(self, item: BatchRequest, job_id: str) -> None:
        count = self.resubmits.get(job_id, 0)
        if count >= MAX_RESUBMITS:
            self._write_error(item, job_id, "job_lost", "the job vanished from Redis (flushed or expired)")
            self.lanes.release(self.in_flight.pop(job_id))
            return
        self.resubmits[job_id] = count + 1
        self.log(f"batch {self.run_id}: job {job_id} vanished from Redis; enqueuing it again")
        self.jobs.submit([(job_id, self._request(item))])

    def _stop_canceled(self) -> None:
        """`kvrq batch cancel` ran: cancel what this client enqueued since, keep what already ended."""
        self.canceled = True
        canceled = self.jobs.cancel(list(self.in_flight))
        self.log(f"batch {self.run_id}: canceled ({canceled} more queued job(s) canceled by this client)")

    def _store_state(self, force: bool = False, state: RunState | None = None) -> str | None:
        """Write counts to the run record every STATE_EVERY_S; returns the state it had (the cancel check)."""
        now = time.monotonic()
        if not force and now - self._last_state_at < STATE_EVERY_S:
            return None
        self._last_state_at = now
        if state is None:
            state = "submitting" if self.lanes.pending() else "running"
        return self.run_record.update(
            state=state,
            queued=self.queued,
            running=self.running,
            done=self.progress.done,
            failed=self.progress.failed,
            invalid=self.invalid,
        )
