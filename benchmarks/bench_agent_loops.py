"""Agent loops that never re-prefill: coding-agent traces replayed against kvrq serve, mlx_lm.server and
vllm-mlx, on the same weights, in one run, one server at a time.

    python benchmarks/bench_agent_loops.py                      # 4 traces x 5 turns, every side and API
    python benchmarks/bench_agent_loops.py --traces 2 --turns 3 --sides kvrq --out /tmp/loops.json
    python benchmarks/bench_agent_loops.py --vllm-mlx /path/to/venv/bin/vllm-mlx   # its own venv

The traces (benchmarks/agent_traces.py): a ~1K-token coding agent's system prompt with seven function
tools (~1.9K tokens as kvrq renders them; SmolLM2's template has no tools, thinking blocks or tool
calls), a task, then turns of an assistant tool call and its result, sent as today's clients send
them: the whole history every turn and no cache key (no prompt_cache_key, no agent id), through
(a) chat completions with the `openai` client, (b) Anthropic messages with the `anthropic` client,
`cache_control` on the system prompt and on the last message, and (c) the Responses API, where a
follow-up sends only the new input beside `previous_response_id`. The model's own answer is the
history: its calls when it made some, else its text followed by the trace's scripted call. Several
traces run at once (one thread each), greedy, `--max-tokens` a turn.

Per request: the prompt's tokens, the tokens the server says it reused (kvrq: usage `cached_tokens`
/ `cache_read_input_tokens` / `input_tokens_details.cached_tokens`; mlx_lm.server: chat usage
`cached_tokens`; vllm-mlx: none in its usage, so its log's `[schedule] ... tokens_to_prefill=N` line
is read, matched by prompt length; its Anthropic stream counts 0 input tokens, so there the prompt's
length is this rendering's), what could be reused (the longest prefix this prompt shares with the
previous turn's prompt + answer tokens, each rendered as that server renders it: kvrq's tool format,
or the plain template that drops tools for the others; kvrq's answer tokens are the job's own), the
share, and the time to the first output at the client (kvrq also gives its worker's first-token
time: the client sees a tool call only once it is whole). Then, per side and API (chat and
messages), an identical prompt sent twice (trace 0's first request under a fresh first line, so
nothing is cached before): the second time everything but the last token is the target, and the
first is a cold prefill measured in this run, from which a reuse estimate by first-token time is
derived for every turn (rough: the traces run concurrently, so it reads low).

Sides: kvrq (a private redis-server, one `kvrq worker` with the builtin smollm2-135m, float32,
default settings, and `kvrq serve`), `mlx_lm.server` (the builtin exported to an mlx-lm folder, as in
bench_agents.py; chat completions only) and vllm-mlx 0.6.0 when `--vllm-mlx` names its executable (in
a venv of its own: it pins mlx-lm < 0.32; `--continuous-batching --enable-prefix-cache`, OpenBLAS with
one thread, as docs/platform.md describes). The sides' order alternates between `--runs`.
Writes benchmarks/results/agent_loops.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.agent_traces import (  # noqa: E402
    Call,
    Trace,
    anthropic_request,
    anthropic_tools,
    chat_messages,
    openai_tools,
    responses_input,
    responses_tools,
)
from benchmarks.common import stop_process  # noqa: E402
from engine.cpu.blas import blas_preload_env, ensure_fast_blas  # noqa: E402

SIDES = ["kvrq", "mlx_lm", "vllm_mlx"]
APIS = ["chat", "messages", "responses"]
SUPPORTED = {"kvrq": APIS, "mlx_lm": ["chat"], "vllm_mlx": APIS}
TARGET_LATER, TARGET_IDENTICAL = 0.95, "all but the last token"


@dataclass
class Reply:
    text: str
    calls: list[Call]
    first_s: float | None  # first output (text, call or reasoning) at the client
    total_s: float
    prompt_tokens: int | None
    reused: int | None  # as the server reports it; None: it reports nothing
    request_id: str | None = None
    response_id: str | None = None


@dataclass
class Server:
    """A running side: where it listens, how to name the model, what it can tell after a request."""

    name: str
    url: str
    model: str
    apis: list[str]
    log_path: Path | None = None
    job_view: Callable[[str], dict[str, Any] | None] | None = None  # kvrq: its job's result by id
    log_offset: int = 0


# ---- the three APIs, as their official clients send them -------------------------------------


def send_chat(server: Server, trace: Trace, max_tokens: int) -> Reply:
    import openai

    client: Any = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=1800)
    started = time.perf_counter()
    stream: Any = client.chat.completions.create(
        model=server.model,
        messages=chat_messages(trace),
        tools=openai_tools(),
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    first, parts, usage = None, [], None
    calls: dict[int, dict[str, str]] = {}
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            delta = choice.delta
            reasoning = getattr(delta, "reasoning_content", None)
            if first is None and (delta.content or delta.tool_calls or reasoning):
                first = time.perf_counter() - started
            if delta.content:
                parts.append(delta.content)
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
                entry["id"] = call.id or entry["id"]
                if call.function is not None:
                    entry["name"] += call.function.name or ""
                    entry["arguments"] += call.function.arguments or ""
    total = time.perf_counter() - started
    details = getattr(usage, "prompt_tokens_details", None) if usage else None
    cached = getattr(details, "cached_tokens", None) if details else None
    return Reply(
        "".join(parts),
        [Call(c["id"] or f"call_{uuid.uuid4().hex[:8]}", c["name"], c["arguments"]) for c in calls.values()],
        first,
        total,
        usage.prompt_tokens if usage else None,
        cached,
        stream.response.headers.get("x-request-id"),
    )


def send_messages(server: Server, trace: Trace, max_tokens: int) -> Reply:
    import anthropic

    client: Any = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=1800)
    body = anthropic_request(trace)
    started = time.perf_counter()
    stream: Any = client.messages.create(
        model=server.model,
        max_tokens=max_tokens,
        system=body["system"],
        messages=body["messages"],
        tools=anthropic_tools(),
        stream=True,
        extra_body={"temperature": 0},  # the SDK has no temperature argument any more
    )
    first, parts, usage = None, [], None
    blocks: dict[int, dict[str, Any]] = {}
    for event in stream:
        kind = event.type
        if kind == "message_start":
            usage = event.message.usage
        elif kind == "content_block_start":
            block = event.content_block
            if block.type == "tool_use":
                blocks[event.index] = {"id": block.id, "name": block.name, "json": ""}
                first = first if first is not None else time.perf_counter() - started
        elif kind == "content_block_delta":
            delta = event.delta
            if first is None and delta.type in ("text_delta", "input_json_delta", "thinking_delta"):
                first = time.perf_counter() - started
            if delta.type == "text_delta":
                parts.append(delta.text)
            elif delta.type == "input_json_delta" and event.index in blocks:
                blocks[event.index]["json"] += delta.partial_json
        elif kind == "message_delta":
            usage = event.usage
    total = time.perf_counter() - started
    calls = [Call(b["id"], b["name"], b["json"] or "{}") for _, b in sorted(blocks.items())]
    prompt, reused = None, None
    if usage is not None:  # vllm-mlx streams input_tokens 0: no count at all
        read = getattr(usage, "cache_read_input_tokens", None)
        prompt = ((getattr(usage, "input_tokens", None) or 0) + (read or 0)) or None
        reused = read
    return Reply(
        "".join(parts), calls, first, total, prompt, reused, stream.response.headers.get("request-id")
    )


def send_responses(server: Server, trace: Trace, max_tokens: int) -> Reply:
    import openai

    client: Any = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=1800)
    started = time.perf_counter()
    stream: Any = client.responses.create(
        model=server.model,
        instructions=trace.system,
        input=responses_input(trace),
        tools=responses_tools(),
        previous_response_id=trace.response_id,
        max_output_tokens=max_tokens,
        temperature=0,
        stream=True,
    )
    first, final = None, None
    for event in stream:
        kind = event.type
        if first is None and (
            kind in ("response.output_text.delta", "response.function_call_arguments.delta")
            or kind == "response.reasoning_text.delta"
            or (kind == "response.output_item.added" and event.item.type == "function_call")
        ):
            first = time.perf_counter() - started
        if kind in ("response.completed", "response.incomplete"):
            final = event.response
    total = time.perf_counter() - started
    if final is None:
        raise RuntimeError(f"{server.name}: the Responses stream ended without its response")
    text = "".join(
        part.text
        for item in final.output
        if item.type == "message"
        for part in item.content
        if part.type == "output_text"
    )
    calls = [Call(i.call_id, i.name, i.arguments) for i in final.output if i.type == "function_call"]
    usage = final.usage
    details = getattr(usage, "input_tokens_details", None) if usage else None
    return Reply(
        text,
        calls,
        first,
        total,
        usage.input_tokens if usage else None,
        getattr(details, "cached_tokens", None) if details else None,
        stream.response.headers.get("x-request-id"),
        final.id,
    )


SENDERS: dict[str, Callable[[Server, Trace, int], Reply]] = {
    "chat": send_chat,
    "messages": send_messages,
    "responses": send_responses,
}


# ---- what each server's prompt is, in tokens --------------------------------------------------


class Renderer:
    """Prompt tokens as each side renders the history: kvrq with its tool format (worker/requests/prompts.py),
    the others with the model's plain template, which drops tools and calls (their answer's text is
    what SmolLM2's template keeps of an assistant turn)."""

    def __init__(self, folder: Path) -> None:
        from mlx_lm.utils import load_tokenizer

        self.tokenizer = load_tokenizer(folder)

    def prompt(self, side: str, trace: Trace) -> list[int]:
        messages = chat_messages(trace)
        if side == "kvrq":
            from producer.batch.format import chat_request
            from producer.models import GenerationRequest
            from worker.requests.prompts import prompt_tokens

            body = {"messages": messages, "tools": openai_tools()}
            return prompt_tokens(self.tokenizer, GenerationRequest(**chat_request(body)))
        plain = [{**m, "content": m.get("content") or ""} for m in copy.deepcopy(messages)]
        if side == "vllm_mlx":
            plain = [_as_vllm_mlx_writes(m) for m in plain]
        rendered = self.tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=True)
        return [int(t) for t in (rendered["input_ids"] if isinstance(rendered, dict) else rendered)]

    def answer(self, side: str, reply: Reply, job: dict[str, Any] | None) -> list[int]:
        """The tokens the server generated (kvrq: the job's own, the end token left out)."""
        if job is not None and job.get("token_ids") is not None:
            ids = list(job["token_ids"])
            eos = set(self.tokenizer.eos_token_ids)
            return ids[:-1] if ids and ids[-1] in eos else ids
        return [int(t) for t in self.tokenizer.encode(reply.text, add_special_tokens=False)]


def _as_vllm_mlx_writes(message: dict[str, Any]) -> dict[str, Any]:
    """vllm-mlx, for a template without tools, writes a result as a user turn `[Tool Result (id)]: ...`
    and a call as a line `[Calling tool: name(arguments)]` after the assistant's text."""
    if message["role"] == "tool":
        return {"role": "user", "content": f"[Tool Result ({message['tool_call_id']})]: {message['content']}"}
    calls = [
        f"[Calling tool: {c['function']['name']}({c['function']['arguments']})]"
        for c in message.get("tool_calls") or []
    ]
    if calls:
        text = "\n".join(([message["content"]] if message["content"] else []) + calls)
        return {"role": message["role"], "content": text}
    return message


def shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# ---- running the traces -----------------------------------------------------------------------


def run_traces(
    server: Server, api: str, renderer: Renderer, traces: int, turns: int, max_tokens: int, tag: str
) -> tuple[list[dict[str, Any]], list[Trace]]:
    """`traces` sessions at once, one thread each, `turns` turns each: (rows, the traces as they ended)."""
    rows: list[dict[str, Any]] = []
    done: list[Trace] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def session(index: int) -> None:
        trace = Trace(index, f"{tag}-{api}-{index}")
        previous: list[int] | None = None
        previous_reported = 0  # the previous prompt's length as the server counted it, + the answer's
        try:
            for turn in range(1, turns + 1):
                prompt = renderer.prompt(server.name, trace)
                sent_at = time.time()
                reply = SENDERS[api](server, trace, max_tokens)
                job = server.job_view(reply.request_id) if server.job_view and reply.request_id else None
                if reply.prompt_tokens is None:  # the server counts nothing: our rendering's count
                    reply.prompt_tokens, counted = len(prompt), False
                else:
                    counted = True
                exact = reply.prompt_tokens == len(prompt)
                could = None
                if previous is not None:  # not our rendering: assume the history extends prompt + answer
                    could = (
                        shared_prefix(previous, prompt)
                        if exact
                        else min(previous_reported, reply.prompt_tokens)
                    )
                answer = renderer.answer(server.name, reply, job)
                previous = prompt + answer
                previous_reported = reply.prompt_tokens + len(answer)
                row = {
                    "trace": index,
                    "turn": turn,
                    "prompt_tokens": reply.prompt_tokens,
                    "rendered_prompt_tokens": len(prompt),
                    "rendering_matches": exact and counted,
                    "prompt_tokens_counted_by_server": counted,
                    "reused": reply.reused,
                    "could_reuse": could,
                    "first_s": _round(reply.first_s),
                    "total_s": _round(reply.total_s),
                    "worker_first_s": _round((job or {}).get("time_to_first_token_s")),
                    "answer_tokens": len(answer),
                    "model_called_a_tool": bool(reply.calls),
                    "sent_at": sent_at,
                }
                with lock:
                    rows.append(row)
                trace.response_id = reply.response_id
                trace.add_step(turn, reply.text, reply.calls)
            with lock:
                done.append(trace)
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=session, args=(i,), daemon=True) for i in range(traces)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return sorted(rows, key=lambda r: (r["trace"], r["turn"])), sorted(done, key=lambda t: t.index)


def identical_twice(server: Server, api: str, renderer: Renderer, max_tokens: int) -> dict[str, Any]:
    """Trace 0's first request under a first line never sent before, sent twice, one after the other."""
    fresh = Trace(0, f"identical-{api}", prefix=f"Request {uuid.uuid4().hex}.\n")
    rendered = renderer.prompt(server.name, fresh)
    sends = []
    for _ in range(2):
        sent_at = time.time()
        reply = SENDERS[api](server, fresh, max_tokens)
        sends.append(
            {
                "prompt_tokens": reply.prompt_tokens or len(rendered),
                "reused": reply.reused,
                "first_s": _round(reply.first_s),
                "total_s": _round(reply.total_s),
                "sent_at": sent_at,
            }
        )
    return {
        "api": api,
        "rendered_prompt_tokens": len(rendered),
        "target_reused": len(rendered) - 1,
        "sends": sends,
    }


# ---- the sides --------------------------------------------------------------------------------


@contextmanager
def kvrq_side(workdir: Path) -> Iterator[Server]:
    from benchmarks.bench_agents import kvrq_worker, wait_ready
    from producer.client import Producer
    from worker.cli.spawn import free_port

    with kvrq_worker() as (redis_url, work), Producer(redis_url) as producer:
        port = free_port()
        log_path = work / "serve.log"
        command = [sys.executable, "-m", "worker.cli", "serve", "--redis", redis_url, "--port", str(port)]
        with open(log_path, "ab") as log:
            proc = subprocess.Popen([*command, "--log-level", "warning"], stdout=log, stderr=log, cwd=ROOT)

        def job_view(job_id: str) -> dict[str, Any] | None:
            try:
                result = producer.handle(job_id).result(timeout=60)
            except Exception:
                return None
            return {
                "token_ids": result.token_ids,
                "time_to_first_token_s": result.timings.time_to_first_token_s if result.timings else None,
            }

        try:
            wait_ready("kvrq serve", port, proc, lambda status, body: b"smollm2" in body, 180, log_path)
            yield Server("kvrq", f"http://127.0.0.1:{port}", "smollm2-135m", APIS, log_path, job_view)
        finally:
            proc.terminate()
            proc.wait(timeout=30)


@contextmanager
def mlx_lm_side(folder: Path, workdir: Path) -> Iterator[Server]:
    from benchmarks.bench_agents import start_server
    from worker.cli.spawn import free_port

    port = free_port()
    proc = start_server(folder, port, workdir / "mlx_lm_server.log", 1)
    try:
        yield Server("mlx_lm", f"http://127.0.0.1:{port}", "default_model", ["chat"])
    finally:
        stop_process(proc)


@contextmanager
def vllm_mlx_side(executable: str, folder: Path, workdir: Path) -> Iterator[Server]:
    options = ["--continuous-batching", "--enable-prefix-cache", "--ssd-cache-dir", str(workdir / "vllm-ssd")]
    with mlx_server_side("vllm_mlx", executable, folder, workdir, "smol", APIS, options) as server:
        yield server


@contextmanager
def mlx_server_side(
    name: str,
    executable: str,
    folder: Path,
    workdir: Path,
    served: str,
    apis: list[str],
    options: Sequence[str] = (),
) -> Iterator[Server]:
    """`EXECUTABLE serve FOLDER` (vllm-mlx, Rapid-MLX) on a free port as model `served`, OpenBLAS
    preloaded, one thread, a HOME of its own under `workdir`; stopped on exit."""
    from benchmarks.bench_agents import wait_ready
    from worker.cli.spawn import free_port

    port = free_port()
    home = workdir / f"{name}-home"
    home.mkdir(exist_ok=True)
    env = {**blas_preload_env(), "HOME": str(home), "OPENBLAS_NUM_THREADS": "1"}
    log_path = workdir / f"{name}.log"
    command = [executable, "serve", str(folder), "--host", "127.0.0.1", "--port", str(port), *options]
    command += ["--served-model-name", served]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=workdir)
    try:
        wait_ready(name.replace("_", "-"), port, proc, lambda status, _: status == 200, 600, log_path)
        yield Server(name, f"http://127.0.0.1:{port}", served, apis, log_path)
    finally:
        stop_process(proc)


SCHEDULED = re.compile(r"\[schedule\] request=(\S+) uid=\d+ prompt_tokens=(\d+) tokens_to_prefill=(\d+)")
FIRST_TOKEN = re.compile(r"\[stream_outputs\] (\S+) first token after ([\d.]+)s")


def reused_from_log(server: Server, rows: list[dict[str, Any]]) -> None:
    """vllm-mlx reports no reuse in its usage: its log's `[schedule]` line of each request says how many
    prompt tokens it prefills (its `[cache_fetch]` line says HIT for an identical prompt that is then
    prefilled whole, so that one is not used), and `[stream_outputs]` when its first token came.
    Matched to requests by prompt length in the order they were sent."""
    if server.log_path is None or server.name != "vllm_mlx":
        return
    with open(server.log_path, "rb") as log:
        log.seek(server.log_offset)
        text = log.read().decode(errors="replace")
        server.log_offset = log.tell()
    firsts = {m[1]: float(m[2]) for m in FIRST_TOKEN.finditer(text)}
    entries = [(m[1], int(m[2]), int(m[3])) for m in SCHEDULED.finditer(text)]
    used = [False] * len(entries)
    for row in sorted(rows, key=lambda r: r["sent_at"]):
        for i, (request, prompt, prefilled) in enumerate(entries):
            if not used[i] and prompt == row["prompt_tokens"]:
                used[i] = True
                row["reused"], row["reused_from"] = prompt - prefilled, "log"
                row["worker_first_s"] = firsts.get(request)
                break


# ---- the report -------------------------------------------------------------------------------


def estimate(rows: list[dict[str, Any]], cold: dict[str, Any] | None) -> None:
    """Reuse guessed from first-token time against the cold prefill of the same side and API:
    prompt x (1 - first / cold time scaled to this prompt's length)."""
    if not cold or not cold.get("first_s") or not cold.get("prompt_tokens"):
        return
    per_token = cold["first_s"] / cold["prompt_tokens"]
    for row in rows:
        if row["first_s"] and row["prompt_tokens"]:
            guess = row["prompt_tokens"] * (1 - row["first_s"] / (per_token * row["prompt_tokens"]))
            row["reused_estimate_from_first_s"] = max(0, min(row["prompt_tokens"], round(guess)))


def per_turn(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for turn in sorted({r["turn"] for r in rows}):
        mine = [r for r in rows if r["turn"] == turn]
        reported = [r for r in mine if r["reused"] is not None]
        could = [r for r in reported if r["could_reuse"]]
        shares = [min(1.0, r["reused"] / r["could_reuse"]) for r in could]
        guesses = [r["reused_estimate_from_first_s"] for r in mine if "reused_estimate_from_first_s" in r]
        firsts = [r["first_s"] for r in mine if r["first_s"] is not None]
        workers = [r["worker_first_s"] for r in mine if r["worker_first_s"] is not None]
        out.append(
            {
                "turn": turn,
                "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in mine),
                "reused": sum(r["reused"] for r in reported) if reported else None,
                "could_reuse": sum(r["could_reuse"] or 0 for r in mine) if turn > 1 else None,
                "share": sum(r["reused"] for r in could) / sum(r["could_reuse"] for r in could)
                if could
                else None,
                "min_share": min(shares) if shares else None,
                "reused_estimate_from_first_s": sum(guesses) if guesses else None,
                "first_s_median": statistics.median(firsts) if firsts else None,
                "worker_first_s_median": statistics.median(workers) if workers else None,
                "tool_calls_by_model": sum(r["model_called_a_tool"] for r in mine),
                "rendering_matches": sum(r["rendering_matches"] for r in mine),
                "requests": len(mine),
            }
        )
    return out


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def fmt(value: Any, pattern: str = "{:.2f}") -> str:
    return "-" if value is None else pattern.format(value)


def print_tables(report: dict[str, Any]) -> None:
    print(
        "\n| run | side | API | turn | prompt tokens | reused | could reuse | share (min) | est. from TTFT "
        "| first output p50 s | worker first token p50 s | model's own calls |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for part in report["parts"]:
        for t in part["turns"]:
            share = "-" if t["share"] is None else f"{t['share']:.1%} ({t['min_share']:.1%})"
            print(
                f"| {part['run']} | {part['side']} | {part['api']} | {t['turn']} | {t['prompt_tokens']} "
                f"| {fmt(t['reused'], '{}')} | {fmt(t['could_reuse'], '{}')} | {share} "
                f"| {fmt(t['reused_estimate_from_first_s'], '{}')} | {fmt(t['first_s_median'])} "
                f"| {fmt(t['worker_first_s_median'])} | {t['tool_calls_by_model']}/{t['requests']} |"
            )
    print(
        "\n| run | side | API | prompt tokens | reused 1st / 2nd send (target) | first output 1st / 2nd s |"
    )
    print("|---|---|---|---|---|---|")
    for probe in report["identical"]:
        a, b = probe["sends"]
        print(
            f"| {probe['run']} | {probe['side']} | {probe['api']} | {probe['rendered_prompt_tokens']} "
            f"| {fmt(a['reused'], '{}')} / {fmt(b['reused'], '{}')} ({probe['target_reused']}) "
            f"| {fmt(a['first_s'])} / {fmt(b['first_s'])} |"
        )


def main() -> int:
    ensure_fast_blas(sys.argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's TERM still stops the servers
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--traces", type=int, default=4, help="sessions at once [4]")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--runs", type=int, default=1, help="runs of every side, order alternating [1]")
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=SIDES)
    parser.add_argument("--apis", nargs="+", choices=APIS, default=APIS)
    parser.add_argument(
        "--identical-apis", nargs="*", choices=APIS[:2], default=APIS[:2], help="where to send a prompt twice"
    )
    parser.add_argument("--vllm-mlx", default=os.environ.get("VLLM_MLX", ""), help="vllm-mlx executable")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "agent_loops.json"))
    args = parser.parse_args()
    sides = [s for s in args.sides if s != "vllm_mlx" or args.vllm_mlx]
    report: dict[str, Any] = {
        "command": " ".join(["python", "benchmarks/bench_agent_loops.py", *sys.argv[1:]]),
        "machine": f"{platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "versions": {name: version(name) for name in ("mlx", "mlx-lm", "openai", "anthropic")},
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "commit": _git("rev-parse", "--short", "HEAD"),
        "uncommitted_changes_in": _git(
            "status", "--porcelain", "--", "engine", "store", "worker", "producer"
        ),
        "sides_run": sides,
        "load_average_before": os.getloadavg(),
        "parts": [],
        "identical": [],
        "errors": [],
    }
    if "vllm_mlx" in args.sides and not args.vllm_mlx:
        report["skipped"] = "vllm_mlx: no --vllm-mlx executable given"
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvrq-agent-loops-") as tmp:
        workdir = Path(tmp)
        folder = workdir / "smollm2-135m-mlx"
        from benchmarks.bench_agents import export_model

        print("exporting the builtin model for the other servers ...", flush=True)
        report["export_check"] = export_model(folder, [{"role": "user", "content": "Say hello."}], 8)
        renderer = Renderer(folder)
        for run in range(1, args.runs + 1):
            for side in sides if run % 2 else sides[::-1]:
                context = {
                    "kvrq": lambda: kvrq_side(workdir),
                    "mlx_lm": lambda: mlx_lm_side(folder, workdir),
                    "vllm_mlx": lambda: vllm_mlx_side(args.vllm_mlx, folder, workdir),
                }[side]
                print(f"run {run}: starting {side} ...", flush=True)
                try:
                    with context() as server:
                        SENDERS["chat"](server, Trace(99, "warm-up"), 2)  # model pages, first step
                        for api in [a for a in args.apis if a in server.apis]:
                            try:
                                measure(server, api, run, args, renderer, report)
                            except Exception as exc:  # one API failing leaves the others measured
                                report["errors"].append(f"run {run} {side} {api}: {exc!r}")
                                print(f"  {side} {api} failed: {exc!r}", flush=True)
                except Exception as exc:
                    report["errors"].append(f"run {run} {side}: {exc!r}")
                    print(f"  {side} failed: {exc!r}", flush=True)
                write(report, args.out)
    report["wall_s"] = round(time.perf_counter() - started, 1)
    report["load_average_after"] = os.getloadavg()
    write(report, args.out)
    print_tables(report)
    print(f"\nwall {report['wall_s']} s; wrote {args.out}")
    return 0


def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
    return done.stdout.strip()


def write(report: dict[str, Any], path: str) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")


def measure(
    server: Server, api: str, run: int, args: argparse.Namespace, renderer: Renderer, report: dict[str, Any]
) -> None:
    """One side's traces through one API, then its identical prompt: a part of the report."""
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    rows, _ = run_traces(server, api, renderer, args.traces, args.turns, args.max_tokens, f"r{run}")
    reused_from_log(server, rows)
    part = {"run": run, "side": server.name, "api": api, "wall_s": round(time.perf_counter() - t0, 1)}
    probe = None
    if api in args.identical_apis:
        probe = identical_twice(server, api, renderer, args.max_tokens)
        probe_rows = [{**s, "turn": 0} for s in probe["sends"]]
        reused_from_log(server, probe_rows)
        for send, row in zip(probe["sends"], probe_rows, strict=True):
            send["reused"] = row["reused"]
            send["server_first_s"] = row.get("worker_first_s")
        report["identical"].append({"run": run, "side": server.name, **probe})
    cold = probe["sends"][0] if probe else _cold_of(report, run, server.name)
    estimate(rows, cold)
    part.update({"load_average": load, "turns": per_turn(rows), "rows": rows})
    report["parts"].append(part)
    write(report, args.out)  # so far: a run cut short keeps what it measured
    print(f"  {server.name} {api}: {part['wall_s']} s", flush=True)


def _cold_of(report: dict[str, Any], run: int, side: str) -> dict[str, Any] | None:
    """The side's cold chat prefill of this run, for APIs measured without a probe of their own."""
    for probe in report["identical"]:
        if probe["run"] == run and probe["side"] == side:
            return dict(probe["sends"][0])
    return None


if __name__ == "__main__":
    raise SystemExit(main())
