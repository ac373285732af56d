"""Agent clients against kvrq serve and its peers, per client and per turn: prompt tokens, tokens
reused, and the first-token time at the client (issue 42's measurement).

    python benchmarks/bench_clients.py                          # every client, 3 turns each, kvrq
    python benchmarks/bench_clients.py --clients claude codex   # some of them
    python benchmarks/bench_clients.py --server kvrq vllm-mlx rapid-mlx \\
        --vllm-mlx /tmp/peer-vllm/bin/vllm-mlx --rapid-mlx /tmp/peer-rapid/bin/rapid-mlx
    python benchmarks/bench_clients.py --out /tmp/clients.json  # the rows as JSON too

The sessions are the conformance suite's (tests/clients/drivers.py): the pinned clients that
`.ci/setup` installs, each in a fresh HOME with no network beyond loopback. Claude Code and Codex
run on the 32K-context test model and opencode on the 8K one (tests/clients/models.py: tiny, answers
`OK`; their prompts outgrow the builtin or their 32,000-token answers would take minutes); llm, aider
and the Agents SDK on the builtin SmolLM2, exported once to an mlx-lm folder (float32, as
bench_agents.py writes it). Every server serves the same folder: kvrq (redis-server, a real
`kvrq worker`, `kvrq serve`), vllm-mlx 0.6 and Rapid-MLX 0.16 (each from its own venv, OpenBLAS
preloaded with one thread: docs/platform.md measured mlx_lm.server 6-15x faster so), one server and one
session at a time. benchmarks/README.md (Client sessions) has the peers' install commands.

Every server sits behind the same recording proxy (tests/clients/proxy.py), so the columns mean the
same for all three: `prompt` and `cached` are what the server's own usage reports (chat
`prompt_tokens_details.cached_tokens`, Anthropic `cache_read_input_tokens`, Responses
`input_tokens_details.cached_tokens`; `-`: none reported), `log` the tokens a peer's log says it did
not prefill (its `[schedule] ... tokens_to_prefill` line, matched in order: vllm-mlx's usage reports
no reuse at all), and `first s` the time from the request reaching the proxy to the first relayed
event that carries content (text, reasoning or tool-call delta; a non-streamed answer: its first
byte, i.e. the whole answer). For kvrq the worker's own view follows (tests/clients/reuse.py): the
tokens each request shares with an earlier one of the session and those it resumed (issue 42 item 6:
>= 95%), and the worker's first-token time. A client a peer fails is recorded with its error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest  # noqa: E402 - drivers skip through pytest when a client is not installed

from benchmarks.bench_agent_loops import SCHEDULED, mlx_server_side, vllm_mlx_side  # noqa: E402
from engine.cpu.blas import ensure_fast_blas  # noqa: E402
from tests.clients import drivers  # noqa: E402
from tests.clients.models import write_ok_model  # noqa: E402
from tests.clients.proxy import Exchange, RecordingProxy  # noqa: E402
from tests.clients.reuse import Turn, session_turns, table  # noqa: E402
from tests.clients.stack import ClientStack, FinishedJob  # noqa: E402

SERVERS = ["kvrq", "vllm-mlx", "rapid-mlx"]
#: The name peers serve the folder under (kvrq serves it under its path).
SERVED = "smol"
GENERATIONS = {"/v1/messages", "/v1/chat/completions", "/v1/responses"}

#: client -> (model it runs on, the driver returning its session)
CLIENTS: dict[str, tuple[str, Callable[[ClientStack, Path], Any]]] = {
    "claude": ("long", drivers.claude_code),
    "codex": ("long", drivers.codex),
    "opencode": ("short", drivers.opencode),
    "llm": ("builtin", drivers.llm_cli),
    "aider": ("builtin", drivers.aider),
    "agents-responses": ("builtin", lambda stack, tmp: drivers.agents_sdk(stack, tmp, "responses")),
    "agents-chat": ("builtin", lambda stack, tmp: drivers.agents_sdk(stack, tmp, "chat")),
}


# ---- the model folders and the servers ---------------------------------------------------------


def model_folder(kind: str, root: Path) -> Path:
    """The mlx-lm folder every server of this kind loads."""
    folder = root / f"model-{kind}"
    if kind == "builtin":
        from benchmarks.bench_agents import export_model

        export_model(folder, [{"role": "user", "content": "Say hello."}], 8)
        return folder
    return write_ok_model(folder, 32768 if kind == "long" else 8192)


class PeerStack(ClientStack):
    """A peer server on the model folder behind the same recording proxy: no worker, so no jobs."""

    def __init__(self, side: Callable[[], Any], workdir: Path) -> None:
        super().__init__(SERVED, workdir)
        self._side = side
        self._exit = ExitStack()
        self.log_path: Path | None = None

    def start(self) -> PeerStack:
        server = self._exit.enter_context(self._side())
        self.log_path = server.log_path
        self.proxy = RecordingProxy(server.url).start()
        return self

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        self._exit.close()

    def finished_jobs(self, since: float = 0.0) -> list[FinishedJob]:
        return []

    def log_size(self) -> int:
        return self.log_path.stat().st_size if self.log_path is not None else 0

    def scheduled_since(self, offset: int) -> list[tuple[int, int]]:
        """(prompt tokens, tokens prefilled) per request its log scheduled after byte `offset`."""
        if self.log_path is None:
            return []
        with open(self.log_path, "rb") as log:
            log.seek(offset)
            text = log.read().decode(errors="replace")
        return [(int(m[2]), int(m[3])) for m in SCHEDULED.finditer(text)]


@contextmanager
def rapid_mlx_side(executable: str, folder: Path, workdir: Path) -> Iterator[Any]:
    """Rapid-MLX serving `folder` with its defaults (prefix cache on), OpenBLAS preloaded, one thread."""
    with mlx_server_side("rapid_mlx", executable, folder, workdir, SERVED, []) as server:
        yield server


def start_stack(server: str, folder: Path, workdir: Path, args: argparse.Namespace) -> ClientStack:
    workdir.mkdir(parents=True)
    if server == "kvrq":
        return ClientStack(str(folder), workdir).start()
    if server == "vllm-mlx":
        return PeerStack(lambda: vllm_mlx_side(args.vllm_mlx, folder, workdir), workdir).start()
    return PeerStack(lambda: rapid_mlx_side(args.rapid_mlx, folder, workdir), workdir).start()


# ---- what the client saw -----------------------------------------------------------------------


def sse_events(exchange: Exchange) -> Iterator[tuple[float, str | None, Any]]:
    """(time relayed, event name, JSON data) of a streamed answer, each when its last byte arrived."""
    buffer = b""
    for at, chunk in exchange.received:
        buffer += chunk.replace(b"\r\n", b"\n")
        *blocks, buffer = buffer.split(b"\n\n")
        for block in blocks:
            name, data = None, None
            for line in block.decode(errors="replace").split("\n"):
                key, _, value = line.partition(":")
                if key == "event":
                    name = value.strip()
                elif key == "data" and value.strip() not in ("", "[DONE]"):
                    try:
                        data = json.loads(value)
                    except ValueError:
                        data = None
            if data is not None:
                yield at, name, data


def carries_content(name: str | None, data: Any) -> bool:
    """An event with answer content in any of the three APIs (not a role, ping or empty delta)."""
    if not isinstance(data, dict):
        return False
    kind = data.get("type", name)
    if kind == "content_block_delta":
        delta = data.get("delta") or {}
        return any(delta.get(k) for k in ("text", "partial_json", "thinking"))
    if isinstance(kind, str) and kind.startswith("response.") and kind.endswith(".delta"):
        return bool(data.get("delta"))
    for choice in data.get("choices") or []:
        delta = choice.get("delta") or {}
        if any(delta.get(k) for k in ("content", "tool_calls", "reasoning_content", "reasoning")):
            return True
    return False


def usage_figures(api: str, usage: dict[str, Any]) -> tuple[int | None, int | None]:
    """(prompt tokens, cached tokens) from one API's usage object; None where it says nothing."""
    if api == "/v1/messages":  # Anthropic: input_tokens leaves out what was read from the cache
        parts = [
            usage.get(k) for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
        ]
        prompt = sum(p for p in parts if isinstance(p, int)) if parts[0] is not None else None
        return prompt, usage.get("cache_read_input_tokens")
    if api == "/v1/responses":
        return usage.get("input_tokens"), (usage.get("input_tokens_details") or {}).get("cached_tokens")
    return usage.get("prompt_tokens"), (usage.get("prompt_tokens_details") or {}).get("cached_tokens")


def found_usages(api: str, data: Any) -> list[dict[str, Any]]:
    """The usage objects an event or a JSON answer carries, wherever its API puts them."""
    if not isinstance(data, dict):
        return []
    holders = [data, data.get("message"), data.get("response")]
    return [h["usage"] for h in holders if isinstance(h, dict) and isinstance(h.get("usage"), dict)]


def request_row(exchange: Exchange) -> dict[str, Any]:
    """One generation request as the client saw it."""
    api = exchange.path.split("?")[0]
    row: dict[str, Any] = {"path": exchange.path, "status": exchange.status, "prompt": None, "cached": None}
    row["first_s"] = row["total_s"] = None
    if not exchange.ok:
        row["error"] = exchange.error[:300]
        return row
    if exchange.received:
        row["total_s"] = round(exchange.received[-1][0] - exchange.sent_at, 3)
    events = list(sse_events(exchange))
    if not events:  # a plain JSON answer: its content comes with its first byte
        body = b"".join(chunk for _, chunk in exchange.received)
        try:
            events = [(exchange.received[0][0], None, json.loads(body))] if body else []
        except ValueError:
            events = []
        firsts = [at for at, _, _ in events]
    else:
        firsts = [at for at, name, data in events if carries_content(name, data)]
    if firsts:
        row["first_s"] = round(firsts[0] - exchange.sent_at, 3)
    for _, _, data in events:
        for usage in found_usages(api, data):
            prompt, cached = usage_figures(api, usage)
            row["prompt"] = prompt if prompt else row["prompt"]  # vllm-mlx streams input_tokens 0
            row["cached"] = cached if cached is not None else row["cached"]
    return row


def add_log_reuse(rows: list[dict[str, Any]], scheduled: list[tuple[int, int]]) -> None:
    """A peer's log figures matched to the session's 2xx requests in order (by prompt length when
    the usage gave one)."""
    left = list(scheduled)
    for row in rows:
        if row["status"] != 200 or not left:
            continue
        match = next((s for s in left if row["prompt"] in (None, s[0])), None)
        if match is not None:
            left.remove(match)
            row["log_prompt"], row["log_reused"] = match[0], match[0] - match[1]


# ---- one session -------------------------------------------------------------------------------


def run_client(name: str, stack: ClientStack, tmp: Path) -> dict[str, Any]:
    """The session's requests as the client saw them (and, on kvrq, the worker's turns), and how it
    ended: ok, or the client's error (a peer's failure is the result, not fixed here)."""
    assert stack.proxy is not None
    mark, started = stack.proxy.mark(), time.time()
    offset = stack.log_size() if isinstance(stack, PeerStack) else 0
    outcome: dict[str, Any] = {"load_avg": [round(x, 2) for x in os.getloadavg()], "result": "ok"}
    try:
        CLIENTS[name][1](stack, tmp)
    except pytest.skip.Exception as exc:
        outcome["result"] = f"skipped: {exc}"
    except Exception as exc:  # the client's failure is the measurement
        outcome["result"] = f"failed: {type(exc).__name__}: {str(exc)[:600]}"
    exchanges = stack.proxy.since(mark)
    generations = [e for e in exchanges if e.method == "POST" and e.path.split("?")[0] in GENERATIONS]
    rows = [request_row(e) for e in generations]
    refused = [e.brief() for e in exchanges if not e.ok]
    if refused and outcome["result"] == "ok":
        outcome["result"] = "refused: " + "; ".join(refused)[:600]
    if isinstance(stack, PeerStack):
        add_log_reuse(rows, stack.scheduled_since(offset))
    else:
        turns = stack_turns(stack, started)
        outcome["worker_turns"] = [{**asdict(t), "resumed_enough": t.resumed_enough} for t in turns]
        ignored = {e.headers["x-kvrq-ignored"] for e in exchanges if "x-kvrq-ignored" in e.headers}
        outcome["x_kvrq_ignored"] = sorted(ignored)
    outcome["requests"] = rows
    return outcome


def stack_turns(stack: ClientStack, started: float) -> list[Turn]:
    return session_turns(stack.finished_jobs(started), stack.model)


def requests_table(rows: list[dict[str, Any]]) -> str:
    def cell(value: Any) -> str:
        return "-" if value is None else str(value)

    lines = ["req  status  prompt  cached     log  first s  total s  path"]
    for number, row in enumerate(rows, 1):
        lines.append(
            f"{number:>3}  {row['status']:>6}  {cell(row['prompt']):>6}  {cell(row['cached']):>6}  "
            f"{cell(row.get('log_reused')):>6}  {cell(row['first_s']):>7}  {cell(row['total_s']):>7}  "
            f"{row['path']}"
        )
    return "\n".join(lines)


def report(server: str, name: str, outcome: dict[str, Any]) -> None:
    print(f"\n## {name} on {server} (load average {outcome['load_avg']}): {outcome['result']}", flush=True)
    print(requests_table(outcome["requests"]))
    if "worker_turns" in outcome:
        print("worker:")
        print(table([_turn(t) for t in outcome["worker_turns"]]))
        print(f"x-kvrq-ignored: {outcome['x_kvrq_ignored'] or 'none'}", flush=True)


def _turn(fields: dict[str, Any]) -> Turn:
    return Turn(**{k: v for k, v in fields.items() if k != "resumed_enough"})


def main() -> None:
    ensure_fast_blas(sys.argv)  # the builtin's export check runs the engine in this process
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", nargs="+", choices=sorted(CLIENTS), default=list(CLIENTS))
    parser.add_argument("--server", nargs="+", choices=SERVERS, default=["kvrq"], help="in this order")
    parser.add_argument("--vllm-mlx", default=os.environ.get("VLLM_MLX", "vllm-mlx"), help="its executable")
    parser.add_argument(
        "--rapid-mlx", default=os.environ.get("RAPID_MLX", "rapid-mlx"), help="its executable"
    )
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args()
    results: dict[str, dict[str, Any]] = {server: {} for server in args.server}
    kinds = list(dict.fromkeys(CLIENTS[name][0] for name in args.clients))
    with tempfile.TemporaryDirectory(prefix="bench-clients-") as tmp:
        root = Path(tmp)
        for kind in kinds:  # one model folder per kind, served by each server in turn
            folder = model_folder(kind, root)
            for server in args.server:
                work = root / f"{server}-{kind}"
                try:
                    stack = start_stack(server, folder, work, args)
                except Exception as exc:  # a peer that does not start is the result too
                    for name in [n for n in args.clients if CLIENTS[n][0] == kind]:
                        results[server][name] = {"result": f"server did not start: {exc!s:.600}"}
                        print(f"\n## {name} on {server}: {results[server][name]['result']}", flush=True)
                    continue
                try:
                    for name in [n for n in args.clients if CLIENTS[n][0] == kind]:
                        results[server][name] = run_client(name, stack, work / name)
                        report(server, name, results[server][name])
                finally:
                    stack.stop()
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
