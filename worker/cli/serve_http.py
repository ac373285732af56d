"""`kvrq serve`: the OpenAI- and Anthropic-compatible HTTP server (producer/http), run by uvicorn.

A producer like any other: it needs the `serve` extra (fastapi, uvicorn), never MLX.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from producer.wire.redact import redact_url
from producer.wire.redis_url import DEFAULT_REDIS_URL

INSTALL_HINT = "kvrq serve needs the serve extra: pip install -e '.[serve]' (fastapi, uvicorn)"
LOOPBACK = "127.0.0.1"
LOOPBACKS = frozenset({LOOPBACK, "localhost", "::1"})
DEFAULT_PORT = 8000


def add_serve_command(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser(
        "serve",
        help="serve OpenAI's and Anthropic's HTTP APIs in front of the queue",
        description="An HTTP front door: /v1/chat/completions, /v1/completions, /v1/messages (and "
        "count_tokens), /v1/models and /health. Each request becomes a kvrq job on the queue of the "
        "workers that serve its model (docs/http.md).",
    )
    serve.add_argument(
        "--redis",
        default=os.environ.get("KVRQ_REDIS_URL", DEFAULT_REDIS_URL),
        help="Redis URL [$KVRQ_REDIS_URL or local]",
    )
    serve.add_argument("--host", default=LOOPBACK, help=f"address to listen on [{LOOPBACK}]")
    serve.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port [{DEFAULT_PORT}]")
    serve.add_argument("--max-body-mb", type=float, default=8.0, help="largest request body, in MB [8]")
    serve.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds a request may wait for its job [600]"
    )
    serve.add_argument(
        "--max-queued", type=int, help="answer 429 while the model's queue holds this many jobs [no limit]"
    )
    serve.add_argument(
        "--api-key-file",
        help="require an API key: one per line, optionally followed by its tenant (KEY TENANT; keys of "
        "one tenant share its agents and prefix reuse, other tenants see none of them); also "
        "$KVRQ_API_KEYS, comma-separated bare keys (docs/security.md, Tenants)",
    )
    serve.add_argument("--log-level", default="info", help="debug, info, warning, error [info]")
    serve.set_defaults(func=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from producer.http.app import ServeSettings, create_app
        from producer.http.guard import load_key_tenants
    except ImportError as exc:
        print(f"{INSTALL_HINT} ({exc})", file=sys.stderr)
        return 2
    level = args.log_level.upper()
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    try:
        keys = load_key_tenants(args.api_key_file)
    except (OSError, ValueError) as exc:
        print(f"kvrq serve: {exc}", file=sys.stderr)
        return 2
    settings = ServeSettings(
        redis_url=args.redis,
        max_body_bytes=int(args.max_body_mb * 1024 * 1024),
        request_timeout_s=args.request_timeout,
        max_queued=args.max_queued,
        api_keys=tuple(keys),
        key_tenants=tuple((key, tenant) for key, tenant in keys.items() if tenant is not None),
    )
    log = logging.getLogger("kvrq.http")
    log.info(
        "kvrq serve on http://%s:%d, Redis %s%s",
        args.host,
        args.port,
        redact_url(args.redis),
        f", {len(keys)} API key(s) of {len({tenant or key for key, tenant in keys.items()})} tenant(s)"
        if keys
        else "",
    )
    if not keys and args.host not in LOOPBACKS:
        log.warning(
            "listening on %s without API keys: anyone who reaches it can run jobs "
            "(--api-key-file or KVRQ_API_KEYS; docs/http.md)",
            args.host,
        )
    # uvicorn stops gracefully on SIGINT / SIGTERM, then raises the signal again under the handlers it
    # found: with these, a requested stop exits 0 (as the worker's and the dashboard's do), not -15.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: None)
    uvicorn.run(
        create_app(settings),
        host=args.host,
        port=args.port,
        log_level=args.log_level.lower(),
        timeout_graceful_shutdown=5,
    )
    return 0
