"""`kvrq batch run|status|cancel`: argparse wiring for batch runs (registered by worker.cli.main).

`add_batch_commands(subparsers)` adds the `batch` command to kvrq's parser; each subcommand stores its
handler as `func` (call `args.func(args)`, which returns the exit status). `python -m producer.batch.cli`
runs the same commands without the rest of kvrq.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from redis import Redis
from redis.exceptions import RedisError

from producer.batch import RunNotFoundError, batch_status, cancel_batch, list_batches, run_batch
from producer.batch.output import OutputLockedError
from producer.wire.protocol import DEFAULT_QUEUE
from producer.wire.redis_url import DEFAULT_REDIS_URL, connect

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def add_batch_commands(subparsers: Any) -> argparse.ArgumentParser:
    """Register `batch run|status|cancel` on an argparse subparsers object; returns the `batch` parser."""
    batch = subparsers.add_parser(
        "batch",
        help="offline batch runs: OpenAI Batch JSONL in, JSONL out, resumable",
        description="Run a JSONL file of OpenAI Batch API requests through kvrq workers.",
    )
    commands = batch.add_subparsers(dest="batch_command", metavar="{run,status,cancel}")
    commands.required = True

    run = commands.add_parser(
        "run",
        help="run (or resume) a batch file",
        description="Enqueue every line of INPUT (OpenAI Batch API request lines) as an rq job and append "
        "one OpenAI Batch output line each to OUTPUT. A line resumes an agent's KV cache with "
        '\'"kvrq": {"agent_id": "a1"}\' next to its custom_id; an agent\'s lines run in file order. '
        "Run the same command again to resume after Ctrl-C or a crash. Exit status: 0 done, "
        "1 canceled, 2 error, 130 interrupted.",
    )
    run.add_argument("input", help="JSONL file of OpenAI Batch API request lines")
    run.add_argument("-o", "--output", required=True, help="JSONL file the result lines are appended to")
    _redis_option(run)
    run.add_argument("--queue", default=DEFAULT_QUEUE, help="rq queue the jobs go to (default: %(default)s)")
    run.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="most jobs of the run queued or running at once (default: what the workers advertise, else 16)",
    )
    run.add_argument(
        "--run-id", default=None, help="name of the run (default: derived from the input, queue and tenant)"
    )
    run.add_argument(
        "--tenant",
        default=None,
        help="run the lines as this tenant's: its agents (kvrq.agent_id) and prefix reuse, walled from "
        "other tenants' (the tenant of `kvrq serve` API keys; docs/security.md, Tenants)",
    )
    run.add_argument(
        "--progress",
        choices=("auto", "bar", "log"),
        default="auto",
        help="a progress bar, log lines, or a bar only on a terminal (default: %(default)s)",
    )
    run.add_argument("--log-interval", type=float, default=10.0, help="seconds between progress log lines")
    run.add_argument("--json", action="store_true", help="print the summary as JSON")
    run.set_defaults(func=cmd_run)

    status = commands.add_parser("status", help="show a run (or the recent runs)")
    status.add_argument("run_id", nargs="?", help="run id (default: list the recent runs)")
    _redis_option(status)
    status.add_argument("--json", action="store_true", help="print JSON")
    status.set_defaults(func=cmd_status)

    cancel = commands.add_parser("cancel", help="cancel a run's queued jobs")
    cancel.add_argument("run_id", help="run id")
    _redis_option(cancel)
    cancel.add_argument("--running", action="store_true", help="also stop the jobs already running")
    cancel.set_defaults(func=cmd_cancel)
    return batch


def _redis_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--redis",
        default=os.environ.get("KVRQ_REDIS_URL", DEFAULT_REDIS_URL),
        help=f"Redis URL (default: $KVRQ_REDIS_URL or {DEFAULT_REDIS_URL})",  # never the secret default
    )


def _err(text: str) -> None:
    print(f"kvrq batch: {text}", file=sys.stderr, flush=True)


def cmd_run(args: argparse.Namespace) -> int:
    progress = {"auto": None, "bar": True, "log": False}[args.progress]
    try:
        summary = run_batch(
            args.input,
            args.output,
            redis_url=args.redis,
            queue=args.queue,
            concurrency=args.concurrency,
            run_id=args.run_id,
            progress=progress,
            log=lambda text: print(text, file=sys.stderr, flush=True),
            log_interval_s=args.log_interval,
            tenant=args.tenant,
        )
    except KeyboardInterrupt:
        _err(f"interrupted; queued jobs keep running. Run the same command again to resume: {args.output}")
        return EXIT_INTERRUPTED
    except (OSError, ValueError, OutputLockedError, RedisError) as exc:
        _err(str(exc))
        return EXIT_USAGE
    if args.json:
        print(json.dumps(summary.to_dict()))
    else:
        print(
            f"{summary.run_id}: {summary.state}, {summary.total} lines: {summary.done} done, "
            f"{summary.failed} failed ({summary.invalid} bad input), {summary.skipped} already done; "
            f"{summary.submitted} enqueued, {summary.reattached} re-attached; "
            f"{summary.generated_tokens} tokens in {summary.wall_s:.1f} s -> {summary.output}"
        )
    return EXIT_OK if summary.state == "done" else EXIT_FAILED


def cmd_status(args: argparse.Namespace) -> int:
    return _with_redis(args.redis, lambda connection: _show_status(connection, args))


def _show_status(connection: Redis, args: argparse.Namespace) -> int:
    if args.run_id is None:
        runs = list_batches(connection)
        if args.json:
            print(json.dumps(runs))
        elif not runs:
            print("no batch runs recorded")
        for info in [] if args.json else runs:
            print(
                f"{info['run_id']}  {info['state']:<10}  {info['done']}/{info['total']} done  "
                f"{info['failed']} failed  queue={info['queue']}  output={info.get('output', '')}"
            )
        return EXIT_OK
    status = batch_status(connection, args.run_id)
    if args.json:
        print(json.dumps(status))
        return EXIT_OK
    jobs = ", ".join(f"{k} {v}" for k, v in status["jobs_by_state"].items()) or "none"
    print(f"run       {status['run_id']} ({status['state']})")
    print(f"queue     {status['queue']}")
    print(
        f"lines     {status['total']}: {status['done']} done, {status['failed']} failed "
        f"({status['invalid']} bad input), {status['queued']} queued, {status['running']} running"
    )
    print(f"jobs      {jobs}")
    print(f"input     {status.get('input', '')}")
    print(f"output    {status.get('output', '')}")
    if "heartbeat_age_s" in status:
        print(f"client    {status.get('client', '?')}, last seen {status['heartbeat_age_s']} s ago")
    return EXIT_OK


def cmd_cancel(args: argparse.Namespace) -> int:
    def cancel(connection: Redis) -> int:
        canceled = cancel_batch(connection, args.run_id, running=args.running)
        print(f"{args.run_id}: canceled, {canceled} job(s) canceled")
        return EXIT_OK

    return _with_redis(args.redis, cancel)


def _with_redis(url: str, action: Callable[[Redis], int]) -> int:
    """Run `action` on a connection to `url`: an unknown run exits 1, Redis trouble 2, each with one line."""
    connection = connect(url)
    try:
        return action(connection)
    except RunNotFoundError as exc:
        _err(str(exc))
        return EXIT_FAILED
    except RedisError as exc:
        _err(str(exc))
        return EXIT_USAGE
    finally:
        connection.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvrq")
    add_batch_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
