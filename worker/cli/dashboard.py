"""`kvrq dashboard`: rq-dashboard for kvrq's Redis, reading everything as JSON, on 127.0.0.1 by default.

rq-dashboard 0.9 passes no serializer in several places even when started with `--json`
(`Worker.all`, `Job.fetch`, `requeue_job`, an execution's job), so rq falls back to pickle there
and its Workers page answers 500 while a kvrq worker holds jobs: kvrq's jobs are JSON. This
process makes JSON rq's fallback before the dashboard serves anything (kvrq never pickles, so
nothing in its Redis needs pickle), and replaces the dashboard's workers list with one that
shows how many jobs (rq executions) each worker holds: a kvrq worker holds many at once, and
rq-dashboard's row has room for only one "current job".

It has no login, and rq-dashboard can cancel, requeue and delete jobs: it listens on 127.0.0.1 and
refuses any other address unless `--allow-remote` says the operator has put a gate in front of it
(HELP_SECURITY; docs/security.md).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import sys
from datetime import datetime
from typing import Any

from redis import Redis

# RUNNING_FIELD / WAITING_FIELD: a kvrq worker's jobs in the engine and jobs held waiting (for KV
# blocks or their agent), in its rq worker hash. Optional: other rq workers have neither.
from producer.wire.protocol import RUNNING_FIELD, WAITING_FIELD
from producer.wire.redact import redact_url
from producer.wire.redis_url import DEFAULT_REDIS_URL, connect

LOOPBACK = "127.0.0.1"
DEFAULT_PORT = 9181
INSTALL_HINT = "kvrq dashboard needs rq-dashboard: pip install -e '.[dashboard]'"
HELP_SECURITY = (
    "The dashboard has no login of its own and can cancel, requeue and delete jobs; kvrq serve's API "
    "keys do not cover it. Keep it on 127.0.0.1 and reach it through an SSH tunnel "
    "(ssh -L 9181:127.0.0.1:9181 HOST), or put an authenticating reverse proxy in front of it (nginx "
    "auth_basic, oauth2-proxy, a VPN) and proxy to 127.0.0.1:PORT. Listening on any other address "
    "takes --allow-remote: say that such a gate is there."
)


def add_dashboard_command(commands: argparse._SubParsersAction) -> None:
    """Register `kvrq dashboard` on the CLI's subcommands."""
    dashboard = commands.add_parser(
        "dashboard",
        help="run rq-dashboard for kvrq's Redis (JSON jobs, jobs held per worker)",
        description="rq-dashboard 0.9 with rq's JSON serializer everywhere and a Workers page that "
        f"counts the jobs each worker holds. {HELP_SECURITY}",
    )
    dashboard.add_argument(
        "--redis",
        default=os.environ.get("KVRQ_REDIS_URL", DEFAULT_REDIS_URL),
        help="Redis URL [$KVRQ_REDIS_URL or local]",
    )
    dashboard.add_argument(
        "--bind", default=LOOPBACK, help=f"address to listen on [{LOOPBACK}]; another needs --allow-remote"
    )
    dashboard.add_argument(
        "--allow-remote",
        action="store_true",
        help="listen on a non-loopback --bind: only behind an authenticating proxy or tunnel (no login here)",
    )
    dashboard.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"port to listen on [{DEFAULT_PORT}]"
    )
    dashboard.add_argument("--poll-interval", type=int, help="page refresh interval in ms [2500]")
    dashboard.set_defaults(func=_cmd_dashboard)


def _cmd_dashboard(args: argparse.Namespace) -> int:
    return serve(
        args.redis,
        bind=args.bind,
        port=args.port,
        poll_interval_ms=args.poll_interval,
        allow_remote=args.allow_remote,
    )


def is_loopback(host: str) -> bool:
    """Whether `host` only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def use_json_everywhere() -> None:
    """Make rq's fallback serializer JSON in this process, and rq-dashboard's own setting too.

    `rq.serializers.resolve_serializer(None)` returns the module's `PickleSerializer` as it is at
    call time, so rebinding that name reaches every place that passes no serializer. Checked
    here, so an rq that resolves differently fails at start instead of serving 500s.
    """
    import rq.serializers
    import rq_dashboard.web
    from rq.serializers import JSONSerializer, resolve_serializer

    rq.serializers.PickleSerializer = JSONSerializer  # type: ignore[assignment]
    rq_dashboard.web.config.serializer = JSONSerializer
    if resolve_serializer(None) is not JSONSerializer:
        raise RuntimeError("this rq resolves its default serializer differently: kvrq dashboard needs rq 3.0")


def worker_row(worker: Any, connection: Redis) -> dict[str, Any]:
    """One worker as rq-dashboard's workers.json lists it, with the jobs it holds counted.

    `current_job` is what the Workers page shows: "idle", or a link to the worker's oldest held
    job whose text says how many it holds (and, for kvrq workers, how many run and wait).
    """
    executions = sorted(worker.get_current_executions(refresh=True), key=lambda e: e.created_at)
    running, waiting = (_int_or_none(v) for v in connection.hmget(worker.key, RUNNING_FIELD, WAITING_FIELD))
    row: dict[str, Any] = {
        "name": worker.name,
        "pid": worker.pid,
        "queues": [queue.name for queue in worker.queues],
        "state": str(worker.get_state()),
        "current_job": _held_summary(executions, running, waiting),
        "held_jobs": len(executions),
        "running_jobs": running,
        "waiting_jobs": waiting,
        "last_heartbeat": worker.last_heartbeat,
        "birth_date": worker.birth_date,
        "successful_job_count": worker.successful_job_count,
        "failed_job_count": worker.failed_job_count,
        "total_working_time": worker.total_working_time,
        "version": getattr(worker, "version", ""),
        "python_version": getattr(worker, "python_version", ""),
    }
    return row


def _held_summary(executions: list[Any], running: int | None, waiting: int | None) -> str | dict[str, Any]:
    if not executions:
        return "idle"
    count = len(executions)
    text = f"busy: {count} job{'s' if count != 1 else ''} held"
    if running is not None and waiting is not None:
        text += f" ({running} running, {waiting} waiting)"
    oldest = executions[0]
    description = created_at = None
    try:
        job = oldest.job
        description, created_at = job.description, _iso(job.created_at)
    except Exception:  # the job expired or was deleted since the worker took it: still count it
        pass
    return {
        "job_id": oldest.job_id,
        "description": description,
        "created_at": created_at,
        "call_string": text,
    }


def _iso(moment: datetime | None) -> str | None:
    return moment.isoformat() if moment is not None else None


def _int_or_none(raw: bytes | str | None) -> int | None:
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None


def workers_json(instance_number: int) -> Any:
    """Replacement view for rq-dashboard's `/<instance>/data/workers.json`."""
    from flask import current_app, jsonify
    from rq import Worker

    connection = current_app.redis_conn  # type: ignore[attr-defined]  # set per request by rq-dashboard
    rows = [worker_row(worker, connection) for worker in Worker.all(connection=connection)]
    rows.sort(key=lambda w: (w["state"], w["queues"], w["name"]))
    return jsonify(workers=rows), {"Cache-Control": "no-store"}


def make_app(redis_url: str, *, poll_interval_ms: int | None = None) -> Any:
    """rq-dashboard's Flask app for one Redis, JSON throughout, with the kvrq workers view."""
    use_json_everywhere()
    from rq_dashboard.cli import make_flask_app
    from rq_dashboard.web import push_rq_connection, upgrade_config

    app = make_flask_app(None, None, None, "")
    app.config["RQ_DASHBOARD_REDIS_URL"] = (redis_url,)
    if poll_interval_ms:
        app.config["RQ_DASHBOARD_POLL_INTERVAL"] = poll_interval_ms
    upgrade_config(app)
    # kvrq's one connection for every request (rq-dashboard would reconnect per request, with its own
    # URL parser that knows no rediss+sentinel:// and none of kvrq's failover handling).
    connection = connect(redis_url)
    app.redis_conn = connection
    hooks = app.before_request_funcs.get("rq_dashboard", [])
    if push_rq_connection not in hooks:
        raise RuntimeError("this rq-dashboard connects differently: kvrq dashboard needs rq-dashboard 0.9")
    hooks[hooks.index(push_rq_connection)] = lambda: setattr(app, "redis_conn", connection)
    endpoint = "rq_dashboard.list_workers"
    if endpoint not in app.view_functions:
        raise RuntimeError(f"this rq-dashboard has no {endpoint} view: kvrq dashboard needs rq-dashboard 0.9")
    app.view_functions[endpoint] = workers_json
    return app


def serve(
    redis_url: str,
    *,
    bind: str = LOOPBACK,
    port: int = DEFAULT_PORT,
    poll_interval_ms: int | None = None,
    allow_remote: bool = False,
) -> int:
    """Serve until SIGINT or SIGTERM (then exit 0): one threaded HTTP server, no Flask banner.
    A non-loopback `bind` without `allow_remote` is refused (exit 2): the dashboard has no login."""
    if not (allow_remote or is_loopback(bind)):
        print(
            f"kvrq dashboard: refusing to listen on {bind}: it has no login and can delete jobs. Put an "
            "authenticating proxy or a tunnel in front and pass --allow-remote (kvrq dashboard --help)",
            file=sys.stderr,
        )
        return 2
    try:
        app = make_app(redis_url, poll_interval_ms=poll_interval_ms)
    except ModuleNotFoundError as exc:
        print(f"{INSTALL_HINT} ({exc})", file=sys.stderr)
        return 2
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request
    try:
        server = make_server(bind, port, app, threaded=True)
    except OSError as exc:
        print(f"kvrq dashboard: cannot listen on {bind}:{port}: {exc.strerror}", file=sys.stderr)
        return 2
    try:
        # Inside the try: a SIGTERM right after the line (a supervisor that waited for it) stops it
        # cleanly too, not as an interrupted command (130).
        signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
        print(f"rq-dashboard on http://{bind}:{server.port} for {redact_url(redis_url)}", flush=True)
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def _raise_keyboard_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
