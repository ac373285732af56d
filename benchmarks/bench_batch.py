"""Batch run benchmark: a 200-line `kvrq batch run` through one worker vs `mlx_lm.batch_generate` in-process.

    python benchmarks/bench_batch.py                 # 200 lines, writes benchmarks/results/batch.json
    python benchmarks/bench_batch.py --quick         # 48 lines, 1 round (a smoke run)

Both paths get the same token prompts (the worker's own chat templating) and the same decode batch size
(worker --max-batch = batch_generate's completion_batch_size). The batch path is the whole thing a user
runs: JSONL parsing, the run record, backpressure, rq jobs through Redis, the worker, fsynced output lines.
Timed from run_batch's call to its return, with the worker already started and warmed up (model load
excluded on both sides). The machine is shared: the two paths alternate and each keeps its best round.
Target: batch wall time / batch_generate wall time <= 1.15.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import machine, write_json  # noqa: E402
from engine.cpu.blas import ensure_fast_blas, openblas_loaded  # noqa: E402

TOPICS = [
    "the capital of France",
    "why the sky is blue",
    "how bees make honey",
    "what a compiler does",
    "how a rainbow forms",
    "the boiling point of water",
    "the tallest mountain on Earth",
    "how to learn to cook",
    "what photosynthesis is",
    "why cats purr",
]
STYLES = [
    "Explain {} in one sentence.",
    "Tell a child about {}.",
    "Write a short note on {}.",
    "What should a student know about {}?",
    "Give one surprising fact about {}.",
]


def batch_lines(count: int, max_tokens: int) -> list[dict[str, Any]]:
    """`count` distinct one-off chat requests in OpenAI Batch format (greedy: both paths comparable)."""
    lines = []
    for i in range(count):
        question = STYLES[(i // len(TOPICS)) % len(STYLES)].format(TOPICS[i % len(TOPICS)])
        lines.append(
            {
                "custom_id": f"q{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "messages": [
                        {"role": "system", "content": f"You are assistant number {i}."},
                        {"role": "user", "content": question},
                    ],
                    "max_tokens": max_tokens,
                    "temperature": 0,
                },
            }
        )
    return lines


def in_process(
    model: Any, tokenizer: Any, prompts: list[list[int]], max_tokens: int, batch: int
) -> dict[str, Any]:
    from mlx_lm import batch_generate

    started = time.perf_counter()
    response = batch_generate(
        model, tokenizer, prompts, max_tokens=max_tokens, completion_batch_size=batch, return_token_ids=True
    )
    elapsed = time.perf_counter() - started
    generated = sum(len(ids) for ids in response.token_ids) if response.token_ids else 0
    return {"seconds": elapsed, "generated_tokens": generated, "texts": list(response.texts)}


def through_batch(
    url: str, workdir: Path, lines: list[dict[str, Any]], concurrency: int | None, tag: str
) -> dict:
    from producer.batch import run_batch

    source = workdir / f"in-{tag}.jsonl"
    output = workdir / f"out-{tag}.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    started = time.perf_counter()
    summary = run_batch(source, output, redis_url=url, concurrency=concurrency, progress=False)
    elapsed = time.perf_counter() - started
    assert summary.state == "done" and summary.done == len(lines), summary
    records = {r["custom_id"]: r for r in map(json.loads, output.read_text().splitlines())}
    texts = [
        records[line["custom_id"]]["response"]["body"]["choices"][0]["message"]["content"] for line in lines
    ]
    return {
        "seconds": elapsed,
        "generated_tokens": summary.generated_tokens,
        "texts": texts,
        "run_id": summary.run_id,
    }


def main() -> int:
    ensure_fast_blas(sys.argv)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="48 lines, one round")
    parser.add_argument("--lines", type=int, default=None, help="input lines [200]")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16, help="decode batch size on both paths [16]")
    parser.add_argument("--concurrency", type=int, default=None, help="batch --concurrency [worker capacity]")
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds [2; 1 with --quick]")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "batch.json"))
    args = parser.parse_args()
    count = args.lines or (48 if args.quick else 200)
    rounds = args.rounds or (1 if args.quick else 2)

    from engine.models.load import load_model
    from producer.models import GenerationRequest
    from worker.cli.spawn import redis_server, worker_process
    from worker.requests.prompts import prompt_tokens

    lines = batch_lines(count, args.max_tokens)
    model, tokenizer = load_model("smollm2-135m")
    prompts = [
        prompt_tokens(tokenizer, GenerationRequest.model_validate({"messages": line["body"]["messages"]}))
        for line in lines
    ]
    report: dict[str, Any] = {
        "machine": {**machine(), "openblas_preloaded": openblas_loaded()},
        "model": "smollm2-135m (float32 on CPU)",
        "lines": count,
        "max_tokens": args.max_tokens,
        "decode_batch": args.batch,
        "prompt_tokens_mean": sum(map(len, prompts)) / len(prompts),
    }
    direct_runs: list[dict[str, Any]] = []
    batch_runs: list[dict[str, Any]] = []
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvrq-bench-batch-")))
        url = stack.enter_context(redis_server(workdir))
        store = f"disk:{workdir / 'cache'}"
        stack.enter_context(worker_process(url, store=store, args=["--max-batch", str(args.batch)]))
        from redis import Redis

        from producer.batch.driver import default_concurrency

        concurrency = args.concurrency or default_concurrency(Redis.from_url(url), "kvrq")
        report["concurrency"] = concurrency
        print(f"warm-up (worker capacity {concurrency}) ...", flush=True)
        through_batch(url, workdir, batch_lines(4, 4), args.concurrency, "warmup")
        in_process(model, tokenizer, prompts[:4], 4, args.batch)
        for round_ in range(rounds):
            print(f"round {round_ + 1}/{rounds}: mlx_lm.batch_generate ...", flush=True)
            direct_runs.append(in_process(model, tokenizer, prompts, args.max_tokens, args.batch))
            print(f"round {round_ + 1}/{rounds}: kvrq batch run ...", flush=True)
            tagged = [
                {**line, "custom_id": f"{line['custom_id']}-r{round_}"} for line in lines
            ]  # a fresh run
            batch_runs.append(through_batch(url, workdir, tagged, args.concurrency, f"r{round_}"))
    direct = min(direct_runs, key=lambda r: r["seconds"])
    batch = min(batch_runs, key=lambda r: r["seconds"])
    same = sum(a == b for a, b in zip(direct["texts"], batch["texts"], strict=True))
    for run in (*direct_runs, *batch_runs):
        run.pop("texts", None)
        run["tokens_per_s"] = run["generated_tokens"] / run["seconds"]
    report["machine"]["load_average_at_end"] = os.getloadavg()
    report["rounds"] = rounds
    report["all_runs_seconds"] = {
        "batch_generate": [round(r["seconds"], 2) for r in direct_runs],
        "kvrq_batch": [round(r["seconds"], 2) for r in batch_runs],
    }
    report["batch_generate"] = direct
    report["kvrq_batch"] = batch
    report["wall_time_ratio"] = batch["seconds"] / direct["seconds"]
    report["target_ratio"] = 1.15
    report["identical_texts"] = f"{same}/{count}"
    write_json(args.out, report)
    print_table(report)
    print(f"\nwrote {args.out}")
    return 0


def print_table(report: dict[str, Any]) -> None:
    print(
        f"\n{report['lines']} lines, max_tokens {report['max_tokens']}, "
        f"decode batch {report['decode_batch']}, concurrency {report['concurrency']}, "
        f"{report['machine']['cpus']} CPUs, best of {report['rounds']} rounds"
    )
    print("| path | generated tokens | wall s | tokens/s |")
    print("|---|---|---|---|")
    for name, key in (
        ("kvrq batch run, 1 worker", "kvrq_batch"),
        ("mlx_lm.batch_generate", "batch_generate"),
    ):
        row = report[key]
        print(f"| {name} | {row['generated_tokens']} | {row['seconds']:.2f} | {row['tokens_per_s']:.1f} |")
    verdict = "meets" if report["wall_time_ratio"] <= report["target_ratio"] else "misses"
    print(
        f"wall-time ratio batch / batch_generate = {report['wall_time_ratio']:.2f} ({verdict} the "
        f"{report['target_ratio']} target); identical texts {report['identical_texts']}"
    )


if __name__ == "__main__":
    sys.exit(main())
