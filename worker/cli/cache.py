"""`kvrq cache list|show|delete|pin|unpin`: agents' caches in a store, for operators.

It opens the store itself (store.open_for_admin: manifests only, no model, no MLX), the one the
workers use: `--store` or KVRQ_STORE (`redis`: KVRQ_REDIS_URL's Redis). Programs call the same
backend methods (`list`, `info`, `delete`, `pin`, `unpin`); Producer has none of them, since
the producer package depends on nothing else in kvrq and the store may not import it
(docs/worker.md, "Agents' caches"). `--tenant` shows one tenant's agents by the ids its clients use
(producer/tenants.py); without it an operator sees every agent, tenants' ones qualified (`t:TENANT:ID`).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import IO, TYPE_CHECKING

from worker.cli.main import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from worker.settings import WorkerSettings

if TYPE_CHECKING:  # the store is imported when a cache command runs, not when the CLI starts
    from producer.tenants import Tenant
    from store.backend import BlockBackend
    from store.base import CacheInfo


def add_cache_commands(commands: argparse._SubParsersAction) -> None:
    cache = commands.add_parser(
        "cache",
        help="agents' KV caches in the store: list, show, delete, pin, unpin",
        description="Agents' caches in the workers' store. A pinned agent is never evicted by the "
        "store's budget (store_max_mb) or TTL; delete removes an agent's blocks and leaves shared "
        "prefix blocks to the other agents that use them.",
    )
    cache.add_argument(
        "--store",
        help="disk:PATH, redis (KVRQ_REDIS_URL's), redis://... or shards:URL|URL|... [$KVRQ_STORE]",
    )
    cache.add_argument(
        "--tenant",
        help="only this tenant's agents, named as its clients name them (docs/security.md, Tenants)",
    )
    actions = cache.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    listing = actions.add_parser(
        "list",
        help="every stored agent, most recently used first",
        description="Every stored agent, most recently used first. SHARED/ALL BLOCKS: of the agent's "
        "blocks (ALL), those in its namespace's shared area (SHARED: full blocks stored once for every "
        "agent of the namespace with the same tokens, kept while any of them uses them). NAMESPACE: the "
        "tenant of the store that last wrote the agent ('-': written before kvrq recorded it).",
    )
    listing.add_argument("--namespace", metavar="NS", help="only the agents of this namespace")
    for name, text in (
        ("show", "one agent's cache"),
        ("delete", "delete agents' caches"),
        ("pin", "keep agents' caches past budget and TTL"),
        ("unpin", "let budget and TTL apply again"),
    ):
        action = actions.add_parser(name, help=text)
        action.add_argument("agents", nargs="+" if name != "show" else 1, metavar="AGENT")
    cache.set_defaults(func=run_cache_command)


def run_cache_command(
    args: argparse.Namespace, out: IO[str] | None = None, err: IO[str] | None = None
) -> int:
    from redis.exceptions import RedisError

    from producer.tenants import tenant_of
    from producer.wire.ids import InvalidAgentIdError
    from producer.wire.redis_url import connect
    from store.errors import StoreError
    from store.factory import open_for_admin

    out, err = out or sys.stdout, err or sys.stderr
    try:
        tenant = tenant_of(getattr(args, "tenant", None))
    except ValueError as exc:
        print(f"kvrq cache: {exc}", file=err)
        return EXIT_USAGE
    settings = WorkerSettings(**({"store": args.store} if args.store else {}))
    try:
        store = open_for_admin(settings.store_uri(), connect=connect)
    except (StoreError, ValueError) as exc:
        print(f"kvrq cache: {exc}", file=err)
        return EXIT_USAGE
    try:
        if args.action == "list":
            return list_agents(store, out, namespace=args.namespace, tenant=tenant)
        return per_agent(store, args.action, args.agents, out, err, tenant=tenant)
    except (InvalidAgentIdError, ValueError) as exc:
        print(f"kvrq cache: {exc}", file=err)
        return EXIT_USAGE
    except (StoreError, RedisError) as exc:  # a Redis (or one shard of a sharded store) went away
        print(f"kvrq cache: the store did not answer: {exc}", file=err)
        return EXIT_FAILED
    finally:
        store.close()


def list_agents(
    store: BlockBackend, out: IO[str], *, namespace: str | None = None, tenant: Tenant | None = None
) -> int:
    agents = store.list()
    if tenant is not None:
        agents = [agent for agent in agents if tenant.own(agent) is not None]
    infos = [info for info in (store.info(agent) for agent in agents) if info is not None]
    if namespace is not None:
        infos = [info for info in infos if info.namespace == namespace]
    if not infos:
        where = "".join(
            (
                f" of tenant {tenant.name}" if tenant is not None else "",
                f" in namespace {namespace}" if namespace is not None else "",
            )
        )
        print(f"no agent caches{where}", file=out)
        return EXIT_OK
    rows = [("AGENT", "NAMESPACE", "TOKENS", "SIZE", "LAST USE", "SHARED/ALL BLOCKS", "PINNED")]
    for info in sorted(infos, key=lambda i: i.last_used, reverse=True):
        rows.append(
            (
                info.agent_id if tenant is None else tenant.unqualified(info.agent_id),
                namespace_text(info.namespace),
                str(info.n_tokens),
                size_text(info.nbytes),
                ago_text(info.last_used),
                f"{info.shared_blocks}/{info.n_blocks}",
                "yes" if info.pinned else "",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip(), file=out
        )
    total = sum(info.nbytes for info in infos)
    print(
        f"{len(infos)} agent(s), {size_text(total)} (shared blocks counted once per agent using them)",
        file=out,
    )
    return EXIT_OK


def per_agent(
    store: BlockBackend,
    action: str,
    agents: list[str],
    out: IO[str],
    err: IO[str],
    *,
    tenant: Tenant | None = None,
) -> int:
    """`action` on each agent (`tenant`: named as the tenant's clients name them)."""
    failed = False
    for agent in agents:
        stored = agent if tenant is None else tenant.agent(agent)
        if action == "show":
            info = store.info(stored)
            if info is None:
                print(f"no cache for agent {agent}", file=err)
                failed = True
            else:
                print(show_text(info, agent), file=out)
            continue
        done = {"delete": store.delete, "pin": store.pin, "unpin": store.unpin}[action](stored)
        if done:
            print(f"agent {agent}: {action}{'d' if action.endswith('e') else 'ned'}", file=out)
        else:
            why = "was not pinned" if action == "unpin" else "has no cache in this store"
            print(f"agent {agent}: {why}", file=err)
            failed = True
    return EXIT_FAILED if failed else EXIT_OK


def show_text(info: CacheInfo, name: str | None = None) -> str:
    """`name`: the agent as the reader knows it (a tenant's client id), else its stored id."""
    return "\n".join(
        (
            f"agent {name or info.agent_id}",
            f"  namespace: {namespace_text(info.namespace)}",
            f"  tokens: {info.n_tokens}",
            f"  size: {size_text(info.nbytes)} ({info.nbytes} bytes, quantization {info.quantization})",
            f"  blocks: {info.n_blocks}, of them in the shared area: {info.shared_blocks}",
            f"  last use: {ago_text(info.last_used)}",
            f"  pinned: {'yes' if info.pinned else 'no'}",
        )
    )


def namespace_text(namespace: str) -> str:
    return namespace or "-"  # "-": a manifest written before kvrq recorded the namespace


def size_text(nbytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def ago_text(at: float) -> str:
    if at <= 0:
        return "unknown"
    seconds = max(0.0, time.time() - at)
    for unit, scale in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= scale:
            return f"{seconds / scale:.0f} {unit} ago"
    return f"{seconds:.0f} s ago"
