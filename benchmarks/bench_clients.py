"""Agent clients against kvrq serve, per client and per turn: prompt tokens, tokens shared with an
earlier request of the session, tokens reused from the KV, and the worker's time to first token.

    python benchmarks/bench_clients.py                          # every client, 3 turns each
    python benchmarks/bench_clients.py --clients claude codex   # some of them
    python benchmarks/bench_clients.py --out /tmp/clients.json  # the rows as JSON too

The sessions are the conformance suite's (tests/clients/drivers.py): the pinned clients that
`.ci/setup` installs, each in a fresh HOME with no network beyond loopback, against redis-server, a
real `kvrq worker` and `kvrq serve`. Claude Code and Codex run on the 32K-context test model and
opencode on the 8K one (tests/clients/models.py: tiny, answers `OK`; their prompts outgrow the
builtin or their 32,000-token answers would take minutes); llm, aider and the Agents SDK on the
builtin SmolLM2. Figures come from the finished jobs in Redis (the worker's usage and timings), the
shared tokens from the prompts rendered again as the worker renders them (tests/clients/reuse.py).
First-token times include the queue; on a busy machine they are long, the reuse is the point.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest  # noqa: E402 - drivers skip through pytest when a client is not installed

from tests.clients import drivers  # noqa: E402
from tests.clients.models import write_ok_model  # noqa: E402
from tests.clients.reuse import Turn, table  # noqa: E402
from tests.clients.session import Session  # noqa: E402
from tests.clients.stack import ClientStack  # noqa: E402

BUILTIN = "smollm2-135m"

#: client -> (stack it runs on, the driver returning its session)
CLIENTS: dict[str, tuple[str, Callable[[ClientStack, Path], Any]]] = {
    "claude": ("long", drivers.claude_code),
    "codex": ("long", drivers.codex),
    "opencode": ("short", drivers.opencode),
    "llm": ("builtin", drivers.llm_cli),
    "aider": ("builtin", drivers.aider),
    "agents-responses": ("builtin", lambda stack, tmp: drivers.agents_sdk(stack, tmp, "responses")),
    "agents-chat": ("builtin", lambda stack, tmp: drivers.agents_sdk(stack, tmp, "chat")),
}


def start_stack(kind: str, root: Path) -> ClientStack:
    if kind == "builtin":
        model = BUILTIN
    else:
        model = str(write_ok_model(root / f"ok-{kind}", 32768 if kind == "long" else 8192))
    workdir = root / f"stack-{kind}"
    workdir.mkdir()
    return ClientStack(model, workdir).start()


def run_client(name: str, stack: ClientStack, tmp: Path) -> list[Turn] | str:
    """The session's turns, or why there are none."""
    try:
        outcome = CLIENTS[name][1](stack, tmp)
    except pytest.skip.Exception as exc:
        return f"skipped: {exc}"
    except AssertionError as exc:
        return f"failed: {str(exc)[:400]}"
    session: Session = outcome[0] if isinstance(outcome, tuple) else outcome
    refused = [exchange.brief() for exchange in session.exchanges() if not exchange.ok]
    if refused:
        return "refused: " + "; ".join(refused)[:400]
    ignored = {e.headers["x-kvrq-ignored"] for e in session.exchanges() if "x-kvrq-ignored" in e.headers}
    print(f"x-kvrq-ignored: {sorted(ignored) or 'none'}", flush=True)
    return session.turns()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", nargs="+", choices=sorted(CLIENTS), default=list(CLIENTS))
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-clients-") as tmp:
        root = Path(tmp)
        stacks: dict[str, ClientStack] = {}
        try:
            for name in args.clients:
                kind = CLIENTS[name][0]
                if kind not in stacks:
                    stacks[kind] = start_stack(kind, root)
                print(f"\n## {name} ({Path(stacks[kind].model).name})", flush=True)
                outcome = run_client(name, stacks[kind], root / name)
                print(outcome if isinstance(outcome, str) else table(outcome), flush=True)
                results[name] = outcome if isinstance(outcome, str) else [asdict(turn) for turn in outcome]
        finally:
            for stack in stacks.values():
                stack.stop()
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
