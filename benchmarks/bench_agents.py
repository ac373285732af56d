"""Agents vs mlx_lm.server: the same multi-turn agent workload through kvrq and through mlx-lm's
own OpenAI-compatible server, on the same weights, on this machine, in the same run.

    python benchmarks/bench_agents.py                       # 12 agents x 3 turns, 2 runs of each side
    python benchmarks/bench_agents.py --agents 2 --turns 2 --max-tokens 8 --runs 1 --out /tmp/a.json
    python benchmarks/bench_agents.py --only server         # one side (no ratios then)
    python benchmarks/bench_agents.py --sides kvrq http     # kvrq's producer path against its HTTP door
    python benchmarks/bench_agents.py --anonymous           # without agent ids: --sides kvrq anon anon-blocks
    python benchmarks/bench_agents.py --restart             # a restart: --sides restart restart-nowarmup

Each agent has its own ~700-token briefing (the system message: a ship, its home port, crew and
cargo, generated from a seed per agent, so every agent's prefix differs from its first tokens).
Turn k+1 sends turn k's messages, the assistant's answer of turn k and a new user question: a
real conversation. All agents run at once (one thread each, its turns one after another),
greedy, `--max-tokens` new tokens per turn. Measured by the client per turn: time to first
token (request sent -> first streamed text) and the turn's total time; per side: the workload's
wall time, turn-1 TTFT and later-turn (turn >= 2) TTFT, median and p95. Both sides get the same
turn-1 messages; from turn 2 on each side carries its own earlier answers (greedy, same weights:
mostly the same text, but batching order may change a float and so a token; the JSON counts the
turn-1 answers that agree).

kvrq: a private redis-server and one `kvrq worker` (builtin smollm2-135m, float32, OpenBLAS
preloaded by the CLI, disk store in a temp dir, its default settings: max batch 16, hot tier),
jobs submitted with `producer.client.Producer` under one `agent_id` per agent, so a later turn
resumes from the agent's saved cache and prefills only the new tokens.

mlx_lm.server (mlx-lm 0.32.2 here): the builtin model exported once to an mlx-lm model folder
(config.json, float32 model.safetensors, tokenizer.json + tokenizer_config.json with the chat
template; checked: mlx_lm.load of the folder gives the same chat-template tokens and the same
greedy text as kvrq's engine), served with `python -m mlx_lm.server` and its defaults, driven
with streaming POST /v1/chat/completions. At those defaults it batches requests
(BatchGenerator; `--decode-concurrency 32`, `--prompt-concurrency 8`, `--prefill-step-size
2048`) and keeps an in-memory LRU prompt cache of at most `--prompt-cache-size 10` KV caches
(no byte limit unless `--prompt-cache-bytes`), keyed by token prefix in a trie: a chat prompt is
cut into segments (system prompt, rest), the cache is saved at the end of the system segment and
after each finished generation (prompt + answer, which replaces the entries that are its
prefixes), and a new request resumes from the longest cached prefix (a longer entry is copied and
trimmed). So each agent holds about one entry between turns, and with more than 10 agents the LRU
evicts some agents' caches; `cached_tokens` (stream_options.include_usage) tells how many
prompt tokens each turn reused, reported next to kvrq's own count. The server gets the worker's environment:
OpenBLAS preloaded (`blas_preload_env()`), OpenBLAS's own thread count. `--server-blas-threads N`
sets OPENBLAS_NUM_THREADS for it: docs/platform.md measured mlx_lm.server's decode 6-15x faster
with 1 thread (its HTTP threads fight OpenBLAS's over the 2 cores), but this workload is mostly
prefill, and a 2-agent smoke run here was no faster with 1 (21 s wall against 19 s).

anon (`--anonymous`): the kvrq side's worker and jobs, each job sent without an `agent_id`: a later turn
can only resume from the prefixes earlier jobs left (the worker's recent in-memory prefixes, and the
store's full blocks, `get_prefix`). Per turn the report gives each job's reuse against its 256-token-
aligned prefix: the tokens it reused over the previous turn's prompt length rounded down to a multiple of
256 (that prompt is a prefix of this one, so its full blocks are reusable by any worker); target from
turn 2 on: at least 90% for every job, wall time within 1.2x of the agent-id side in the same run.
anon-blocks: the same with the worker's recent prefixes off (KVRQ_RECENT_PREFIX_MB=0), so every reused
token comes from the store's full blocks, as on a worker that did not run the previous turn.

http: kvrq behind its own HTTP front door (`kvrq serve`, docs/http.md): the same redis-server and
worker as the kvrq side, plus a `kvrq serve` process, driven by the very client that drives
mlx_lm.server (streaming POST /v1/chat/completions with include_usage), each agent named by
`prompt_cache_key`. Against the kvrq side it shows what HTTP costs; against the server side it is
the comparison an OpenAI client sees.

restart (`--restart`): the kvrq side's workload on a warm worker, then the worker is stopped (SIGTERM,
graceful) and a fresh `kvrq worker` process starts on the same disk store; once it has registered, every
agent takes one more turn at once. Reported: that turn's first token p50 / p90 against the warm worker's
later-turn p50 in the same run (target: p50 within 1.5x), and against a turn every agent took at once on
the warm worker just before the restart (the same burst without the restart), and against the burst's
median floor: mlx-lm's forward of the model body on the shortest suffixes the median agent's first
token needs (half the burst's, in one flat call; no history, no intake: a lower bound; median_floor).
restart-nowarmup: the same with the fresh worker's engine warm-up off (KVRQ_WARMUP=0), to show what the
warm-up buys.

Every run starts fresh processes on every side (empty caches); the order of the sides alternates
between runs. Writes benchmarks/results/agents.json.
"""

from __future__ import annotations

import argparse
import functools
import gc
import http.client
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import machine, percentile, stop_process, write_json  # noqa: E402
from engine.cpu.blas import blas_preload_env, ensure_fast_blas  # noqa: E402

Message = dict[str, str]
SIDES = ["kvrq", "server", "http", "anon", "anon-blocks", "restart", "restart-nowarmup"]
BLOCK_TOKENS = 256  # the store's block: the unit anonymous reuse is measured in

SHIPS = ["Albatross", "Boreas", "Cormorant", "Dunlin", "Egret", "Fulmar", "Gannet", "Heron"]
SHIPS += ["Ibis", "Jacana", "Kestrel", "Lapwing", "Merlin", "Nightjar", "Osprey", "Petrel"]
TOWNS = ["Aberlin", "Brackwater", "Caldmouth", "Dunmore", "Eskhaven", "Farrow Bay", "Greyport", "Holmsted"]
TOWNS += ["Inverkeld", "Jarrow Point", "Kilbrae", "Lowestoft Reach", "Marrick", "Northcombe", "Oban Sound"]
CREW = ["Ada", "Bram", "Cato", "Dora", "Ewan", "Freya", "Gus", "Hilde", "Ivo", "Jonas", "Kaia", "Lorne"]
CARGO = ["salt cod", "oak planks", "wool bales", "copper wire", "barley", "lamp oil", "slate", "tea chests"]
WEATHER = [
    "a westerly gale",
    "thick fog",
    "a flat calm",
    "sleet from the north",
    "a long swell",
    "rain squalls",
]
GEAR = ["bilge pump", "foresail", "starboard winch", "galley stove", "radio", "anchor chain"]
STATES = ["needs grease", "is worn", "was mended", "leaks a little", "works well again"]
MEALS = ["fish stew", "pea soup", "oat cakes", "mutton pie"]
QUESTIONS = [
    "What cargo is aboard right now?",
    "Who is the cook, and what do they think of the weather?",
    "Which port do we reach next, and when?",
    "Name one repair the ship needs.",
    "Summarise yesterday's log entry in one sentence.",
    "What should the captain worry about tonight?",
]


def briefing(agent: int) -> str:
    """A deterministic ~700-token system message, different for every agent from its first words."""
    rng = random.Random(agent)
    ship = SHIPS[agent % len(SHIPS)] + ("" if agent < len(SHIPS) else f" {agent // len(SHIPS) + 1}")
    home = TOWNS[agent % len(TOWNS)]
    crew = rng.sample(CREW, 5)
    lines = [
        f"You are the log keeper of the coaster {ship}, home port {home}. Answer in one or two short "
        f"sentences, using only the log below. The captain is {crew[0]}, the mate {crew[1]}, the cook "
        f"{crew[2]}, the engineer {crew[3]} and the deck hand {crew[4]}."
    ]
    for day in range(1, 11):
        port = rng.choice([t for t in TOWNS if t != home])
        cargo = rng.sample(CARGO, 2)
        lines.append(
            f"Day {day}: left {port} at {rng.randint(4, 11)} in the morning with {rng.randint(3, 40)} tons "
            f"of {cargo[0]} and {rng.randint(2, 25)} crates of {cargo[1]}; met {rng.choice(WEATHER)}, "
            f"made {rng.randint(40, 140)} miles; {rng.choice(crew)} noted that the "
            f"{rng.choice(GEAR)} {rng.choice(STATES)}, and {rng.choice(crew)} cooked {rng.choice(MEALS)}."
        )
    return "\n".join(lines)


def question(agent: int, turn: int) -> str:
    return QUESTIONS[(agent + turn) % len(QUESTIONS)]


@dataclass
class Answer:
    text: str
    ttft_s: float | None
    total_s: float
    prompt_tokens: int
    reused_tokens: int
    # kvrq only, the worker's own view (producer.models.Timings): where a first token's time went
    worker: dict[str, float | None] | None = None
    # kvrq only: the job's milestones (worker/loop/timeline.py), unix seconds and engine steps
    timeline: dict[str, float] | None = None


Ask = Callable[[int, list[Message]], Answer]


def drive(
    ask: Ask, agents: int, turns: int, chats: dict[int, list[Message]] | None = None
) -> tuple[float, list[dict[str, Any]]]:
    """All agents at once, one thread each, each agent's turns in order: (wall seconds, rows).

    `chats` (the restart side): each agent's conversation so far, continued here and extended in place."""
    rows: list[dict[str, Any]] = []
    errors: list[BaseException] = []
    chats = {} if chats is None else chats

    def agent_loop(agent: int) -> None:
        chat = chats.setdefault(agent, [{"role": "system", "content": briefing(agent)}])
        done = sum(m["role"] == "assistant" for m in chat)
        try:
            for turn in range(done, done + turns):
                chat.append({"role": "user", "content": question(agent, turn)})
                answer = ask(agent, list(chat))
                chat.append({"role": "assistant", "content": answer.text})
                rows.append({"agent": agent, "turn": turn + 1, **asdict(answer)})
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=agent_loop, args=(a,), daemon=True) for a in range(agents)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    if errors:
        raise errors[0]
    return wall, sorted(rows, key=lambda r: (r["agent"], r["turn"]))


# ---- kvrq ------------------------------------------------------------------------------------


@contextmanager
def kvrq_worker(env: dict[str, str] | None = None) -> Iterator[tuple[str, Path]]:
    """A private redis-server and one `kvrq worker` on the builtin model (`env`: more settings for it):
    (Redis URL, a work folder)."""
    from benchmarks.procs import RedisProcess, WorkerProcess

    with tempfile.TemporaryDirectory(prefix="kvrq-agents-") as tmp:
        workdir = Path(tmp)
        redis = RedisProcess(workdir)
        redis.start()
        settings = {"KVRQ_HEARTBEAT_INTERVAL": "5", **(env or {})}
        worker = WorkerProcess(redis.url, workdir, name="agents", env=settings)
        try:
            worker.start()
            yield redis.url, workdir
        finally:
            worker.stop()
            redis.stop()


def run_kvrq(
    args: argparse.Namespace, *, anonymous: bool = False, env: dict[str, str] | None = None
) -> tuple[float, list[dict[str, Any]]]:
    """The producer path: one agent id per agent, or (`anonymous`) none, the whole conversation re-sent."""
    from producer.client import Producer

    with kvrq_worker(env) as (redis_url, _), Producer(redis_url) as producer:
        warm_up = producer.submit({"prompt": "Hello", "max_tokens": 2})  # model pages, first step
        warm_up.result(timeout=300)
        return drive(kvrq_asker(producer, args.max_tokens, anonymous=anonymous), args.agents, args.turns)


def kvrq_asker(
    producer: Any, max_tokens: int, *, anonymous: bool = False, job_timeout: int | None = None
) -> Ask:
    """One streamed job per call through `producer` (a producer.client.Producer)."""

    def ask(agent: int, messages: list[Message]) -> Answer:
        started = time.perf_counter()
        job: dict[str, Any] = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
        if job_timeout is not None:
            job["job_timeout"] = job_timeout
        if not anonymous:
            job["agent_id"] = f"agent-{agent}"
        handle = producer.submit(job)
        first, parts = None, []
        for delta in handle.stream(timeout=1200):
            if delta and first is None:
                first = time.perf_counter() - started
            parts.append(delta)
        total = time.perf_counter() - started
        result = handle.result(timeout=60)
        usage, timings = result.usage, result.timings
        worker_view = {
            "queued_s": timings.queued_s,
            "cache_load_s": timings.cache_load_s,
            "engine_ttft_s": timings.engine_time_to_first_token_s,
            "ttft_s": timings.time_to_first_token_s,
        }
        timeline = handle.meta().get("progress", {}).get("timeline")
        return Answer(
            "".join(parts), first, total, usage.prompt_tokens, usage.reused_tokens, worker_view, timeline
        )

    return ask


# ---- restart ----------------------------------------------------------------------------------


def run_restart(args: argparse.Namespace, *, warmup: bool) -> tuple[float, list[dict[str, Any]]]:
    """The kvrq side's workload on a warm worker, then a restart: SIGTERM (a graceful stop), a fresh
    `kvrq worker` process on the same disk store (`KVRQ_WARMUP` on or off), and once it has registered
    every agent takes one more turn at once. Rows of that turn carry `after_restart`; the wall time is
    the warm part's."""
    from benchmarks.procs import RedisProcess, WorkerProcess
    from producer.client import Producer

    env = {"KVRQ_HEARTBEAT_INTERVAL": "5", "KVRQ_WARMUP": "1" if warmup else "0"}
    with tempfile.TemporaryDirectory(prefix="kvrq-agents-restart-") as tmp:
        workdir = Path(tmp)
        redis = RedisProcess(workdir)
        redis.start()
        before = WorkerProcess(redis.url, workdir, name="agents-before", env=env)
        after = WorkerProcess(redis.url, workdir, name="agents-after", env=env)  # same store: workdir/cache
        try:
            with Producer(redis.url) as producer:
                before.start()
                producer.submit({"prompt": "Hello", "max_tokens": 2}).result(timeout=300)
                # A loaded machine's turn 1 (12 briefings prefilled at once) outlasted rq's 600 s default.
                ask = kvrq_asker(producer, args.max_tokens, job_timeout=3600)
                chats: dict[int, list[Message]] = {}
                wall, rows = drive(ask, args.agents, args.turns, chats)
                _, burst = drive(ask, args.agents, 1, chats)  # all at once on the warm worker: the reference
                rows += [{**row, "warm_burst": True} for row in burst]
                stopping = time.perf_counter()
                code = before.terminate()
                stopped = time.perf_counter()
                after.start()
                started = time.perf_counter()
                print(
                    f"  restart: stop {stopped - stopping:.1f} s (exit {code}), start to registered "
                    f"{started - stopped:.1f} s",
                    flush=True,
                )
                _, returning = drive(ask, args.agents, 1, chats)
            rows += [{**row, "after_restart": True} for row in returning]
            return wall, sorted(rows, key=lambda r: (r["agent"], r["turn"]))
        finally:
            before.stop()
            after.stop()
            redis.stop()


def restart_summary(rows: list[dict[str, Any]], *, floor: bool = True) -> dict[str, Any] | None:
    """First tokens of the turn after the restart against the warm worker's later turns (same run);
    `floor`: with the compute floor of that burst's median (one run's burst only, not pooled runs)."""
    restarted = [r for r in rows if r.get("after_restart")]
    if not restarted:
        return None
    warm = [r["ttft_s"] for r in rows if r["turn"] >= 2 and not _special(r) and r["ttft_s"]]
    bursts = [r["ttft_s"] for r in rows if r.get("warm_burst") and r["ttft_s"]]
    burst_p50 = statistics.median(bursts) if bursts else None
    ttft = [r["ttft_s"] for r in restarted if r["ttft_s"] is not None]
    warm_p50 = statistics.median(warm) if warm else None
    p50, p90 = (statistics.median(ttft), percentile(ttft, 0.9)) if ttft else (None, None)
    return {
        "ttft_p50_s": p50,
        "ttft_p90_s": p90,
        "warm_later_ttft_p50_s": warm_p50,
        "ratio_p50": round(p50 / warm_p50, 2) if p50 and warm_p50 else None,
        "ratio_p90": round(p90 / warm_p50, 2) if p90 and warm_p50 else None,
        "warm_burst_ttft_p50_s": burst_p50,
        "ratio_p50_to_warm_burst": round(p50 / burst_p50, 2) if p50 and burst_p50 else None,
        "reused_share": sum(r["reused_tokens"] for r in restarted)
        / max(1, sum(r["prompt_tokens"] for r in restarted)),
        "worker_median_s": worker_medians(restarted),
        "warm_worker_median_s": worker_medians([r for r in rows if r["turn"] >= 2 and not _special(r)]),
        "warm_burst_worker_median_s": worker_medians([r for r in rows if r.get("warm_burst")]),
        **(median_floor(restarted, warm_p50) if floor else {}),
    }


def median_floor(restarted: list[dict[str, Any]], warm_p50: float | None) -> dict[str, Any]:
    """A lower bound on the burst's median first token, measured here after the workers stopped.

    The k-th first token of a burst needs at least the k shortest suffixes (prompt tokens not
    resumed) through the model, however a scheduler splits them: the median needs the k = n/2 and
    n/2 + 1 shortest (n even). The bound is mlx-lm's own forward of the model body on that many tokens
    in one flat call, best of 3: no attention to the agents' stored history, no head, no job intake,
    no client, so the real floor is above it."""
    suffixes = sorted(r["prompt_tokens"] - r["reused_tokens"] for r in restarted)
    n = len(suffixes)
    ks = [n // 2, n // 2 + 1] if n % 2 == 0 else [n // 2 + 1]
    seconds = [body_forward_s(sum(suffixes[:k])) for k in ks]
    floor_s = statistics.mean(seconds)
    return {
        "suffix_tokens": suffixes,
        "median_floor_tokens": [sum(suffixes[:k]) for k in ks],
        "median_floor_s": round(floor_s, 3),
        "median_floor_ratio": round(floor_s / warm_p50, 2) if warm_p50 else None,
    }


@functools.cache
def _reference_body() -> Any:
    """The builtin model's body, loaded once per bench process (after the workers stopped)."""
    from engine.models.load import load_model

    return load_model()[0].model


def body_forward_s(n_tokens: int, repeats: int = 3) -> float:
    """Seconds mlx-lm's SmolLM2 body takes on `n_tokens` tokens at once (the builtin model, best of 3)."""
    import mlx.core as mx

    body = _reference_body()
    tokens = mx.array([[100 + i % 4000 for i in range(n_tokens)]])
    mx.eval(body(tokens))  # first use
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        mx.eval(body(tokens))
        best = min(best, time.perf_counter() - started)
    return best


def _special(row: dict[str, Any]) -> bool:
    """The restart side's all-at-once turns (not later turns of the ordinary workload)."""
    return bool(row.get("after_restart") or row.get("warm_burst"))


# ---- mlx_lm.server ---------------------------------------------------------------------------


def export_model(folder: Path, check_messages: list[Message], max_tokens: int) -> dict[str, Any]:
    """Write the builtin model as an mlx-lm folder; assert mlx_lm.load of it matches kvrq's engine."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import generate, load

    from engine.batch.engine import BlockPoolBatchEngine
    from engine.core.params import SamplingParams
    from engine.models.load import BUILTIN_MODEL, load_model

    model, tokenizer = load_model(BUILTIN_MODEL)
    folder.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in asdict(model.args).items() if v is not None}
    config["eos_token_id"] = sorted(tokenizer.eos_token_ids)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    hf = tokenizer._tokenizer
    hf.backend_tokenizer.save(str(folder / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": hf.bos_token,
        "eos_token": hf.eos_token,
        "unk_token": hf.unk_token,
        "pad_token": hf.pad_token,
        "chat_template": hf.chat_template,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1))

    prompt = list(tokenizer.apply_chat_template(check_messages, add_generation_prompt=True))
    engine = BlockPoolBatchEngine(model, tokenizer, model_name=BUILTIN_MODEL, pool_mb=256)
    engine.submit(None, prompt, SamplingParams(max_tokens=max_tokens), keep_cache=False)
    ours = ""
    while engine.has_work():
        for completion in engine.step().completions:
            ours = completion.text
    engine.close()

    loaded = load(str(folder))
    exported_model, exported_tokenizer = loaded[0], loaded[1]
    exported_prompt = list(exported_tokenizer.apply_chat_template(check_messages, add_generation_prompt=True))
    assert exported_prompt == prompt, "the exported tokenizer renders the chat differently"
    assert set(exported_tokenizer.eos_token_ids) == set(tokenizer.eos_token_ids), "EOS tokens differ"
    theirs = generate(
        exported_model, exported_tokenizer, exported_prompt, max_tokens=max_tokens, verbose=False
    )
    assert theirs == ours, f"mlx_lm.load of the export generates {theirs!r}, kvrq's engine {ours!r}"
    del model, exported_model, engine, loaded
    gc.collect()
    mx.clear_cache()
    return {"passed": True, "prompt_tokens": len(prompt), "max_tokens": max_tokens, "text": ours}


def start_server(folder: Path, port: int, log_path: Path, blas_threads: int) -> subprocess.Popen[bytes]:
    env = blas_preload_env()
    if blas_threads > 0:
        env["OPENBLAS_NUM_THREADS"] = str(blas_threads)
    command = [sys.executable, "-m", "mlx_lm.server", "--model", str(folder)]
    command += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "WARNING"]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    wait_ready("mlx_lm.server", port, proc, lambda status, _: status == 200, 300, log_path)
    return proc


def wait_ready(
    name: str,
    port: int,
    proc: subprocess.Popen[bytes],
    ready: Callable[[int, bytes], bool],
    timeout: float,
    log_path: Path,
) -> None:
    """Until GET /health on `port` answers as `ready` says (status, body); the log shown if it exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{log_path.read_text()}")
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            connection.request("GET", "/health")
            response = connection.getresponse()
            if ready(response.status, response.read()):
                return
        except OSError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"{name} was not ready within {timeout:.0f} s")


def ask_server(port: int, messages: list[Message], max_tokens: int, agent: str | None = None) -> Answer:
    """One streamed chat request to an OpenAI-compatible server (mlx_lm.server, or kvrq serve with the
    agent as `prompt_cache_key`)."""
    body: dict[str, Any] = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if agent is not None:
        body["prompt_cache_key"] = agent
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=1200)
    started = time.perf_counter()
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise RuntimeError(f"the server answered {response.status}: {response.read()[:500]!r}")
    first, parts = None, []
    usage: dict[str, Any] = {}
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue  # blank lines and ": keepalive" comments
        if line == "data: [DONE]":
            break
        chunk = json.loads(line.removeprefix("data: "))
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices", []):
            text = choice.get("delta", {}).get("content")
            if text:
                if first is None:
                    first = time.perf_counter() - started
                parts.append(text)
    total = time.perf_counter() - started
    connection.close()
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return Answer("".join(parts), first, total, int(usage.get("prompt_tokens", 0)), int(cached))


def run_server(args: argparse.Namespace, folder: Path) -> tuple[float, list[dict[str, Any]]]:
    from worker.cli.spawn import free_port

    port = free_port()
    proc = start_server(folder, port, folder.parent / "server.log", args.server_blas_threads)
    try:
        ask_server(port, [{"role": "user", "content": "Hello"}], 2)  # model pages, first step
        return drive(
            lambda agent, messages: ask_server(port, messages, args.max_tokens), args.agents, args.turns
        )
    finally:
        stop_process(proc)


# ---- kvrq serve -------------------------------------------------------------------------------


def run_http(args: argparse.Namespace) -> tuple[float, list[dict[str, Any]]]:
    from worker.cli.spawn import free_port

    with kvrq_worker() as (redis_url, workdir):
        port = free_port()
        command = [sys.executable, "-m", "worker.cli", "serve", "--redis", redis_url, "--port", str(port)]
        log_path = workdir / "serve.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen([*command, "--log-level", "warning"], stdout=log, stderr=log, cwd=ROOT)
        try:  # ready once it lists the worker's model
            wait_ready("kvrq serve", port, proc, lambda status, body: b"smollm2" in body, 120, log_path)
            ask_server(port, [{"role": "user", "content": "Hello"}], 2)  # model pages, first step
            return drive(
                lambda agent, messages: ask_server(port, messages, args.max_tokens, agent=f"agent-{agent}"),
                args.agents,
                args.turns,
            )
        finally:
            proc.terminate()
            proc.wait(timeout=30)


# ---- report ----------------------------------------------------------------------------------


def side_summary(
    side: str, run: int, wall: float, rows: list[dict[str, Any]], load: list[Any]
) -> dict[str, Any]:
    first = [r["ttft_s"] for r in rows if r["turn"] == 1 and r["ttft_s"] is not None]
    later_rows = [r for r in rows if r["turn"] >= 2 and not _special(r)]
    later = [r["ttft_s"] for r in later_rows if r["ttft_s"] is not None]
    return {
        "side": side,
        "run": run,
        "wall_s": round(wall, 2),
        "turns": len(rows),
        "ttft_turn1_median_s": statistics.median(first) if first else None,
        "ttft_turn1_p95_s": percentile(first, 0.95),
        "ttft_later_median_s": statistics.median(later) if later else None,
        "ttft_later_p95_s": percentile(later, 0.95),
        "turn_total_median_s": statistics.median(r["total_s"] for r in rows),
        "reused_share_later_turns": sum(r["reused_tokens"] for r in later_rows)
        / max(1, sum(r["prompt_tokens"] for r in later_rows)),
        "later_worker_median_s": worker_medians(later_rows),
        "aligned_reuse_by_turn": aligned_reuse(rows),
        "restart": restart_summary(rows, floor=run > 0),
        "load_average_before": load[0],
        "load_average_after": load[1],
        "rows": rows,
    }


def aligned_reuse(rows: list[dict[str, Any]]) -> dict[str, dict[str, float | int]]:
    """Per turn from 2 on: each job's reused tokens over its 256-token-aligned prefix (the previous
    turn's prompt, a prefix of this one, rounded down to whole blocks): min, median, and how many jobs
    reached 90%."""
    previous = {(r["agent"], r["turn"]): r["prompt_tokens"] for r in rows}
    by_turn: dict[int, list[float]] = {}
    for r in rows:
        aligned = previous.get((r["agent"], r["turn"] - 1), 0) // BLOCK_TOKENS * BLOCK_TOKENS
        if r["turn"] >= 2 and aligned:
            by_turn.setdefault(r["turn"], []).append(r["reused_tokens"] / aligned)
    return {
        str(turn): {
            "min": round(min(shares), 3),
            "median": round(statistics.median(shares), 3),
            "at_least_90": sum(share >= 0.9 for share in shares),
            "jobs": len(shares),
        }
        for turn, shares in sorted(by_turn.items())
    }


def worker_medians(rows: list[dict[str, Any]]) -> dict[str, float] | None:
    """Medians of the worker's own timings (kvrq only): what a later turn's first token waited on."""
    views = [r["worker"] for r in rows if r.get("worker")]
    if not views:
        return None
    keys = [k for k in views[0] if all(v.get(k) is not None for v in views)]
    return {k: round(statistics.median(v[k] for v in views), 3) for k in keys}


#: (slower, faster) pairs whose ratios the report gives, where both sides ran.
RATIO_PAIRS = (
    ("server", "kvrq"),
    ("server", "http"),
    ("http", "kvrq"),
    ("anon", "kvrq"),
    ("anon-blocks", "kvrq"),
)


def ratios(faster: dict[str, Any], slower: dict[str, Any]) -> dict[str, float | None]:
    def ratio(key: str) -> float | None:
        a, b = faster.get(key), slower.get(key)
        return round(b / a, 2) if a and b else None

    return {"wall": ratio("wall_s"), "ttft_later_median": ratio("ttft_later_median_s")}


def pooled(side: str, runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """All runs of one side together: mean wall, TTFT percentiles over every turn of every run."""
    mine = [r for r in runs if r["side"] == side]
    if not mine:
        return None
    rows = [row for r in mine for row in r["rows"]]
    summary = side_summary(side, 0, statistics.mean(r["wall_s"] for r in mine), rows, [None, None])
    del summary["rows"], summary["load_average_before"], summary["load_average_after"]
    return summary


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_table(report: dict[str, Any]) -> None:
    print(
        "\n| run | side | wall s | turn-1 TTFT p50 / p95 s | later TTFT p50 / p95 s | turn total p50 s "
        "| prompt reused (later turns) | load avg before -> after |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in [*report["runs"], *[p for p in report["pooled"].values() if p]]:
        load = (
            f"{r['load_average_before'][0]:.1f} -> {r['load_average_after'][0]:.1f}"
            if "load_average_before" in r
            else "-"
        )
        print(
            f"| {r['run'] or 'all'} | {r['side']} | {r['wall_s']:.1f} "
            f"| {fmt(r['ttft_turn1_median_s'])} / {fmt(r['ttft_turn1_p95_s'])} "
            f"| {fmt(r['ttft_later_median_s'])} / {fmt(r['ttft_later_p95_s'])} "
            f"| {fmt(r['turn_total_median_s'])} | {r['reused_share_later_turns']:.0%} | {load} |"
        )
    reuse = [(r, turn, v) for r in report["runs"] for turn, v in r["aligned_reuse_by_turn"].items()]
    if any(r["side"].startswith("anon") for r, _, _ in reuse):
        print("\n| run | side | turn | reuse of the 256-aligned prefix min / median | jobs >= 90% |")
        print("|---|---|---|---|---|")
        for r, turn, v in reuse:
            print(
                f"| {r['run']} | {r['side']} | {turn} | {v['min']:.0%} / {v['median']:.0%} "
                f"| {v['at_least_90']} of {v['jobs']} |"
            )
    if report["ratios"]:
        print("\n| run | sides | wall | later-turn TTFT p50 |")
        print("|---|---|---|---|")
        for run, by_pair in report["ratios"].items():
            for pair, rat in by_pair.items():
                print(f"| {run} | {pair} | {fmt(rat['wall'])} | {fmt(rat['ttft_later_median'])} |")


def print_restarts(runs: list[dict[str, Any]]) -> None:
    def split(medians: dict[str, float]) -> str:
        return f"{fmt(medians.get('cache_load_s'), 3)} / {fmt(medians.get('engine_ttft_s'), 3)}"

    restarted = [r for r in runs if r.get("restart")]
    if not restarted:
        return
    print(
        "\n| run | side | restart TTFT p50 / p90 s | warm later-turn TTFT p50 s | ratio p50 / p90 "
        "| warm burst TTFT p50 s (ratio) | median floor s (/ warm later-turn) | reused after restart "
        "| worker: cache load / engine TTFT p50 s (restart; warm) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in restarted:
        x = r["restart"]
        mine, warm = x["worker_median_s"] or {}, x["warm_worker_median_s"] or {}
        print(
            f"| {r['run']} | {r['side']} | {fmt(x['ttft_p50_s'])} / {fmt(x['ttft_p90_s'])} "
            f"| {fmt(x['warm_later_ttft_p50_s'])} | {fmt(x['ratio_p50'])} / {fmt(x['ratio_p90'])} "
            f"| {fmt(x.get('warm_burst_ttft_p50_s'))} ({fmt(x.get('ratio_p50_to_warm_burst'))}) "
            f"| {fmt(x.get('median_floor_s'))} ({fmt(x.get('median_floor_ratio'))}) "
            f"| {x['reused_share']:.0%} | {split(mine)}; {split(warm)} |"
        )


def main() -> int:
    ensure_fast_blas(sys.argv)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--agents", type=int, default=12)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--only", choices=SIDES, help="run one side")
    parser.add_argument("--sides", nargs="+", choices=SIDES, help="run these sides [kvrq server]")
    parser.add_argument(
        "--anonymous",
        action="store_true",
        help="the workload without agent ids against the agent-id path: --sides kvrq anon anon-blocks",
    )
    parser.add_argument(
        "--restart",
        action="store_true",
        help="a worker restart on a warm store, with and without warm-up: --sides restart restart-nowarmup",
    )
    parser.add_argument(
        "--server-blas-threads",
        type=int,
        default=1,
        help="OPENBLAS_NUM_THREADS for mlx_lm.server; 0: unset [1]",
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "agents.json"))
    args = parser.parse_args()
    default_sides = ["kvrq", "anon", "anon-blocks"] if args.anonymous else ["kvrq", "server"]
    if args.restart:
        default_sides = ["restart", "restart-nowarmup"]
    sides = [args.only] if args.only else args.sides or default_sides

    report: dict[str, Any] = {
        "command": " ".join(["python", "benchmarks/bench_agents.py", *sys.argv[1:]]),
        "machine": {**machine(), "mlx": version("mlx"), "mlx_lm": version("mlx-lm")},
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "load_average_before": os.getloadavg(),
    }
    with tempfile.TemporaryDirectory(prefix="kvrq-agents-export-") as tmp:
        folder = Path(tmp) / "smollm2-135m-mlx"
        if "server" in sides:
            print("exporting the builtin model for mlx_lm.server ...", flush=True)
            check = [{"role": "system", "content": briefing(0)}, {"role": "user", "content": question(0, 0)}]
            report["export_check"] = export_model(folder, check, args.max_tokens)
            print(f"export check passed: {report['export_check']['text']!r}", flush=True)
        runs: list[dict[str, Any]] = []
        for run in range(1, args.runs + 1):
            for side in sides if run % 2 else sides[::-1]:
                print(f"run {run}: {side} ({args.agents} agents x {args.turns} turns) ...", flush=True)
                before = os.getloadavg()
                runners: dict[str, Callable[[argparse.Namespace], tuple[float, list[dict[str, Any]]]]] = {
                    "kvrq": run_kvrq,
                    "anon": lambda a: run_kvrq(a, anonymous=True),
                    "anon-blocks": lambda a: run_kvrq(a, anonymous=True, env={"KVRQ_RECENT_PREFIX_MB": "0"}),
                    "http": run_http,
                    "server": lambda a: run_server(a, folder),
                    "restart": lambda a: run_restart(a, warmup=True),
                    "restart-nowarmup": lambda a: run_restart(a, warmup=False),
                }
                wall, rows = runners[side](args)
                runs.append(side_summary(side, run, wall, rows, [before, os.getloadavg()]))
                print(f"  wall {wall:.1f} s", flush=True)
    report["load_average_after"] = os.getloadavg()
    report["runs"] = runs
    report["pooled"] = {side: pooled(side, runs) for side in sides}
    report["ratios"] = {}
    pairs = [(slow, fast) for slow, fast in RATIO_PAIRS if slow in sides and fast in sides]
    for run in [*range(1, args.runs + 1), 0]:
        summary = {r["side"]: r for r in runs if r["run"] == run} if run else report["pooled"]
        report["ratios"][str(run or "all")] = {f"{s} / {f}": ratios(summary[f], summary[s]) for s, f in pairs}
    if not pairs:
        report["ratios"] = {}
    if "kvrq" in sides and "server" in sides:
        report["same_turn1_answers"] = [
            sum(
                a["text"] == b["text"]
                for a in r["rows"]
                for b in s["rows"]
                if a["turn"] == b["turn"] == 1 and a["agent"] == b["agent"]
            )
            for r, s in zip(
                [r for r in runs if r["side"] == "kvrq"],
                [r for r in runs if r["side"] == "server"],
                strict=True,
            )
        ]
    out = write_json(args.out, report)
    print(
        f"\n{args.agents} agents x {args.turns} turns, {args.max_tokens} new tokens a turn; "
        f"load average {report['load_average_before'][0]:.1f} -> {report['load_average_after'][0]:.1f}"
    )
    print_table(report)
    print_restarts(report["runs"])
    if "same_turn1_answers" in report:
        print(
            f"\nturn-1 answers equal on both sides, per run: {report['same_turn1_answers']} of {args.agents}"
        )
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
