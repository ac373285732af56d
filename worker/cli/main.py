"""`kvrq`: worker, generate, status, maintenance, demo, batch, up, dashboard, cache, serve.

Only `kvrq worker` imports MLX (engine, store), and only once it runs: the other commands
are Redis clients and start at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from redis.exceptions import RedisError

from producer.wire.protocol import DEFAULT_QUEUE
from producer.wire.redact import redact_url
from producer.wire.redis_url import DEFAULT_REDIS_URL, RedisURLError, connect
from worker.settings import WorkerSettings

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def _redis_url() -> str:
    return os.environ.get("KVRQ_REDIS_URL", DEFAULT_REDIS_URL)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvrq",
        description="LLM agents on MLX behind an rq/Redis job queue, resumed from their KV caches.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True

    worker = commands.add_parser(
        "worker",
        help="run a worker: batches queued jobs into one model",
        description="Run a kvrq worker. Every flag can also be set as KVRQ_<NAME> (see docs/worker.md).",
    )
    worker.add_argument("--model", help="builtin model name, mlx-lm model id or path [smollm2-135m]")
    worker.add_argument("--redis", dest="redis_url", help=f"Redis URL [{DEFAULT_REDIS_URL}]")
    worker.add_argument(
        "--store",
        help="agent cache store: disk:PATH, redis (the queue's), redis://... or shards:URL|URL|... "
        "(docs/scale-out.md) [disk:.kvrq/cache]",
    )
    worker.add_argument("--store-quantization", choices=("none", "q8", "q4"), help="KV quantization at rest")
    worker.add_argument(
        "--kv-bits",
        type=int,
        choices=(8, 4),
        help="keep running K/V quantized to 8 or 4 bits (unset: full precision)",
    )
    worker.add_argument(
        "--draft-model",
        help="a small model of the same tokenizer that drafts tokens (mlx-lm id or path; unset: each "
        "row's own context drafts, docs/worker.md)",
    )
    worker.add_argument(
        "--kv-group-size", type=int, choices=(32, 64, 128), help="values per group of --kv-bits [64]"
    )
    worker.add_argument(
        "--queue", dest="queues", action="append", help=f"queue to serve (repeat) [{DEFAULT_QUEUE}]"
    )
    worker.add_argument("--pool-mb", type=float, help="KV block pool size in MB [2048]")
    worker.add_argument("--pool-blocks", type=int, help="KV block pool size in 256-token blocks")
    worker.add_argument("--max-batch", type=int, help="sequences decoded together [16]")
    worker.add_argument("--name", help="rq worker name [kvrq.HOST.PID.xxxx]")
    worker.add_argument(
        "--drain-timeout", type=float, help="SIGTERM: seconds running jobs get to finish [30]"
    )
    worker.add_argument(
        "--heartbeat-ttl", type=int, help="seconds without heartbeat before jobs count as abandoned [90]"
    )
    worker.add_argument(
        "--liveness-ttl", type=float, help="seconds after a worker's death until others see it gone [10]"
    )
    worker.add_argument(
        "--crash-reruns", type=int, help="re-runs of a job whose worker died, before it fails [2]"
    )
    worker.add_argument(
        "--metrics-port", type=int, help="serve Prometheus metrics on 127.0.0.1:PORT (off if unset)"
    )
    worker.add_argument("--log-level", help="DEBUG, INFO, WARNING, ERROR [INFO]")
    worker.set_defaults(func=_cmd_worker)

    generate = commands.add_parser("generate", help="enqueue one job and stream its answer")
    generate.add_argument("prompt", help="the user message (or raw prompt with --raw)")
    generate.add_argument(
        "--agent", help="agent id: the message continues the agent's conversation (and resumes its KV cache)"
    )
    generate.add_argument(
        "--new",
        action="store_true",
        help="with --agent: start the agent's conversation over with this message",
    )
    generate.add_argument("--system", help="system message")
    generate.add_argument(
        "--raw", action="store_true", help="send the prompt as raw text, without chat template"
    )
    generate.add_argument("--max-tokens", type=int, default=256)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--seed", type=int)
    generate.add_argument("--timeout", type=float, default=None, help="seconds to wait for the answer")
    _client_options(generate)
    generate.set_defaults(func=_cmd_generate)

    status = commands.add_parser("status", help="queues, workers and jobs")
    status.add_argument("--redis", default=_redis_url(), help="Redis URL [$KVRQ_REDIS_URL or local]")
    status.add_argument("--queue", dest="queues", action="append", help="queue to show (repeat) [all]")
    status.set_defaults(func=_cmd_status)

    maintenance = commands.add_parser(
        "maintenance",
        help="re-run jobs of workers that died (crash re-runs, abandoned-job cleanup)",
        description="Started jobs of workers that are gone (no liveness key) or stuck (heartbeat expired) "
        "go back to the head of their queue while their crash budget lasts, else to the failed registry. "
        "Live workers do this every few seconds.",
    )
    maintenance.add_argument("--redis", default=_redis_url(), help="Redis URL [$KVRQ_REDIS_URL or local]")
    maintenance.add_argument("--queue", dest="queues", action="append", help="queue to clean (repeat) [all]")
    maintenance.add_argument(
        "--dead-worker",
        help="name of a worker known to be dead: its jobs are re-run now, "
        "without waiting for its liveness key to expire",
    )
    maintenance.set_defaults(func=_cmd_maintenance)

    demo = commands.add_parser(
        "demo",
        help="two agents, three turns each: see the warm resume from the KV cache",
    )
    _client_options(demo)
    demo.add_argument(
        "--spawn", action="store_true", help="start a private redis-server and worker, stop them after"
    )
    demo.add_argument(
        "--spawn-worker", action="store_true", help="start a worker (for --redis), stop it after"
    )
    demo.add_argument("--store", help="store of the spawned worker [a temporary directory]")
    demo.add_argument("--max-tokens", type=int, default=48)
    demo.add_argument("--timeout", type=float, default=600)
    demo.set_defaults(func=_cmd_demo)

    from producer.batch.cli import add_batch_commands

    add_batch_commands(commands)

    from worker.cli.stack import add_stack_commands

    add_stack_commands(commands)

    from worker.cli.agent import add_agent_commands
    from worker.cli.cache import add_cache_commands

    add_cache_commands(commands)
    add_agent_commands(commands, _redis_url())

    from worker.cli.serve_http import add_serve_command

    add_serve_command(commands)
    return parser


def _client_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--redis", default=_redis_url(), help="Redis URL [$KVRQ_REDIS_URL or local]")
    parser.add_argument("--queue", default=DEFAULT_QUEUE, help=f"queue [{DEFAULT_QUEUE}]")


def worker_settings(args: argparse.Namespace) -> WorkerSettings:
    """Environment (KVRQ_*) first, flags on top."""
    flags: dict[str, Any] = {
        name: getattr(args, name)
        for name in (
            "model",
            "redis_url",
            "store",
            "store_quantization",
            "kv_bits",
            "draft_model",
            "kv_group_size",
            "pool_mb",
            "pool_blocks",
            "max_batch",
            "name",
            "drain_timeout",
            "heartbeat_ttl",
            "liveness_ttl",
            "crash_reruns",
            "metrics_port",
            "log_level",
        )
        if getattr(args, name, None) is not None
    }
    if args.queues:
        flags["queues"] = ",".join(args.queues)
    return WorkerSettings(**flags)


def _cmd_worker(args: argparse.Namespace) -> int:
    settings = worker_settings(args)
    connect(settings.redis_url)  # a malformed URL stops here, before minutes of model loading
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if logging.getLogger().level > logging.DEBUG:
        logging.getLogger("rq.worker").setLevel(logging.WARNING)  # kvrq logs one line per job itself
    from worker.process import serve

    return serve(settings)


def _cmd_generate(args: argparse.Namespace) -> int:
    from producer.models import ChatMessage, GenerationRequest
    from worker.cli.commands import generate

    if args.raw:
        fields: dict[str, Any] = {
            "prompt": args.prompt if args.system is None else f"{args.system}\n{args.prompt}"
        }
    else:
        messages = [ChatMessage(role="user", content=args.prompt)]
        if args.system is not None:
            messages.insert(0, ChatMessage(role="system", content=args.system))
        fields = {"messages": messages, "continue": args.agent is not None and not args.new}
    request = GenerationRequest(
        agent_id=args.agent,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
        **fields,
    )
    return generate(args.redis, args.queue, request, timeout=args.timeout)


def _cmd_status(args: argparse.Namespace) -> int:
    from worker.cli.commands import status

    return status(args.redis, args.queues)


def _cmd_maintenance(args: argparse.Namespace) -> int:
    from worker.cli.commands import maintenance

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return maintenance(args.redis, args.queues, args.dead_worker)


def _cmd_demo(args: argparse.Namespace) -> int:
    from worker.cli.demo import demo

    return demo(
        args.redis,
        args.queue,
        spawn_redis=args.spawn,
        spawn_worker=args.spawn or args.spawn_worker,
        store=args.store,
        max_tokens=args.max_tokens,
        timeout=args.timeout,
    )


def _fast_blas(argv: list[str]) -> None:
    """Re-exec `argv` with OpenBLAS preloaded where that helps (engine/cpu/blas.py); a checkout
    without engine/cpu starts on MLX's own BLAS. Imported here: the client commands import no engine."""
    from engine.core.cpu_package import cpu_module

    blas = cpu_module("blas")
    if blas is not None:
        blas.ensure_fast_blas(argv)


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["worker"]:
        _fast_blas(sys.argv if argv is None else [sys.argv[0], *arguments])
    parser = build_parser()
    args = parser.parse_args(arguments)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130
    except RedisURLError as exc:  # a usage error, as argparse's are: one line, exit 2
        print(f"kvrq: {exc}", file=sys.stderr)
        return 2
    except RedisError as exc:  # bad credentials, TLS, a Redis that is down: one line, no traceback
        url = getattr(args, "redis", None) or getattr(args, "redis_url", None) or _redis_url()
        print(f"kvrq: Redis at {redact_url(url)}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
