"""`kvrq agent show|reset|delete`: an agent's conversation and cache, for people and scripts.

The conversation lives in the queue's Redis (producer/conversation.py) and in the agent's cache
manifest in the store; these commands read and clear both. An agent with jobs still held or running
is left alone: a running turn would write its conversation back right after a reset. `--tenant` names
a tenant's agent by the id its clients use (producer/tenants.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import IO, Any

from worker.cli.main import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from worker.settings import WorkerSettings


def add_agent_commands(commands: argparse._SubParsersAction, redis_default: str) -> None:
    agent = commands.add_parser(
        "agent",
        help="an agent's conversation: show, reset (start over), delete",
        description="What kvrq remembers of an agent: its conversation (what `continue` jobs and "
        "`kvrq generate --agent` append to) and its KV cache. reset: the conversation and cache go, a "
        "pin stays; delete: everything goes, pin included.",
    )
    actions = agent.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    texts = {
        "show": "the agent's messages and cache",
        "reset": "start the agent over: its conversation and cache go",
        "delete": "forget the agent: conversation, cache and pin",
    }
    for name, text in texts.items():
        action = actions.add_parser(name, help=text)
        action.add_argument("agent_id", metavar="AGENT")
        action.add_argument(
            "--redis", default=redis_default, help="the queue's Redis URL [$KVRQ_REDIS_URL or local]"
        )
        action.add_argument("--store", help="disk:PATH, redis (the queue's) or redis://... [$KVRQ_STORE]")
        action.add_argument(
            "--tenant", help="the agent of this tenant (AGENT as its clients name it; docs/security.md)"
        )
        if name == "show":
            action.add_argument("--json", action="store_true", help="the messages as a JSON array")
    agent.set_defaults(func=run_agent_command)


def run_agent_command(
    args: argparse.Namespace, out: IO[str] | None = None, err: IO[str] | None = None
) -> int:
    from producer.tenants import Tenant
    from producer.wire.ids import agent_id_problem
    from producer.wire.redis_url import connect

    out, err = out or sys.stdout, err or sys.stderr
    try:
        if (problem := agent_id_problem(args.agent_id)) is not None:
            raise ValueError(problem)
        tenant = getattr(args, "tenant", None)
        args.stored_id = args.agent_id if tenant is None else Tenant(tenant).agent(args.agent_id)
    except ValueError as exc:
        print(f"kvrq agent: {exc}", file=err)
        return EXIT_USAGE
    connection = connect(args.redis)
    try:
        if args.action == "show":
            return show(connection, args, out, err)
        return forget(connection, args, out, err)
    finally:
        connection.close()


def show(connection: Any, args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    from producer.conversation import read_conversation

    record = read_conversation(connection, args.stored_id)
    info = _with_store(args, err, lambda store: store.info(args.stored_id))
    if record is None and info is None:
        print(f"kvrq agent: agent {args.agent_id} has no conversation and no cache", file=err)
        return EXIT_FAILED
    messages = [] if record is None else record.message_dicts()
    if args.json:
        print(json.dumps(messages, indent=2), file=out)
        return EXIT_OK
    print(f"agent {args.agent_id}", file=out)
    print(f"  messages: {len(messages)}" + ("" if record is None else f" (turn {record.fence})"), file=out)
    if record is not None and record.tools:
        print(f"  tools: {', '.join(tool.function.name for tool in record.tools)}", file=out)
    cached = "none" if info is None else f"{info.n_tokens} tokens{', pinned' if info.pinned else ''}"
    print(f"  cache: {cached}", file=out)
    for message in messages:
        print(_message_line(message), file=out)
    return EXIT_OK


def _message_line(message: dict[str, Any]) -> str:
    parts = [str(message.get("content") or "")]
    for call in message.get("tool_calls") or ():
        parts.append(f"[call {call['function']['name']}({call['function']['arguments']})]")
    return f"  {message['role']}: " + " ".join(p for p in parts if p).replace("\n", "\n    ")


def forget(connection: Any, args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    from producer.conversation import forget_conversation
    from producer.wire.protocol import agent_jobs_key

    held = int(connection.zcard(agent_jobs_key(args.stored_id)))
    if held:
        print(
            f"kvrq agent: agent {args.agent_id} has {held} job(s) held or running; wait for them to end "
            "(or cancel them), then run this again",
            file=err,
        )
        return EXIT_FAILED

    def clear(store: Any) -> bool:
        if args.action == "delete":
            store.unpin(args.stored_id)
        return bool(store.delete(args.stored_id))

    had_conversation = forget_conversation(connection, args.stored_id)
    had_cache = _with_store(args, err, clear)
    if not had_conversation and not had_cache:
        print(f"kvrq agent: agent {args.agent_id} has no conversation and no cache", file=err)
        return EXIT_FAILED
    done = "reset: its next job starts a new conversation" if args.action == "reset" else "deleted"
    print(f"agent {args.agent_id}: {done}", file=out)
    return EXIT_OK


def _with_store(args: argparse.Namespace, err: IO[str], action: Any) -> Any:
    """`action(store)` on the workers' store; None (said on `err`) when it cannot be opened."""
    from producer.wire.redis_url import connect
    from store.errors import StoreError
    from store.factory import open_for_admin

    settings = WorkerSettings(**({"store": args.store} if args.store else {}), redis_url=args.redis)
    try:
        store = open_for_admin(settings.store_uri(), connect=connect)
    except (StoreError, ValueError) as exc:
        print(
            f"kvrq agent: the store is not readable ({exc}); only the conversation is shown or cleared",
            file=err,
        )
        return None
    try:
        return action(store)
    finally:
        store.close()
