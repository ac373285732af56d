"""Structured output's cost, same run: the grammar mask against the decode step it rides in.

`--only step`: the builtin model, 16 rows decoding (each ~300 tokens of prompt), the median step with
no grammar vs every row under a JSON schema (its logits masked by engine/batch/grammar.py), alternated
so both sides see the same machine; plus the mask's own time a step (the 16 rows' processor calls).
Target (issue 25): the mask costs under 10% of a 16-row decode step.

`--only calls`: forced tool calls (issue 31) over the corpus's BFCL function definitions (each entry's
top-level properties are its functions and their parameter schemas): the builtin model (kvrq's tool format,
its template declares none) must call with tool_choice "required" (parallel calls for the parallel subsets),
rendered, split and parsed exactly as the worker does; every call must name an offered function and its
arguments validate against that function's schema. Counts: valid / invalid calls, rows cut by max_tokens,
definitions refused (by the request model's metaschema check or llguidance) with their reason.

The per-token mask over real-world schemas: bench_schemas.py (its `mask_us_*`).
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.cpu.blas import ensure_fast_blas  # noqa: E402

CORPUS = Path(__file__).resolve().parents[2] / "shared/data/jsonschemabench/maskbench-dev.jsonl.gz"
ROWS = 16
SCHEMA = {
    "type": "object",
    "properties": {"summary": {"type": "string"}, "score": {"type": "integer"}},
    "required": ["summary", "score"],
}


def bench_step(rounds: int, steps: int) -> dict[str, Any]:
    from engine.batch.engine import BlockPoolBatchEngine
    from engine.core.params import OutputGrammar, SamplingParams
    from engine.models.load import load_model

    model, tokenizer = load_model()
    engine = BlockPoolBatchEngine(model, tokenizer, model_name="smollm2", pool_mb=1536, max_batch=ROWS)
    messages = [{"role": "user", "content": "Summarise the plot of a long novel in JSON. " * 20}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    grammar = OutputGrammar("json_schema", json.dumps(SCHEMA), "bench")
    mask_s: list[float] = []

    def timed_processor(processor: Any) -> Any:
        def call(tokens: Any, logits: Any) -> Any:
            started = time.perf_counter()
            out = processor(tokens, logits)
            mask_s.append(time.perf_counter() - started)
            return out

        call.ends_row = processor.ends_row  # type: ignore[attr-defined]
        return call

    def median_step(with_grammar: bool) -> tuple[float, float]:
        mask_s.clear()
        for row in range(ROWS):
            params = SamplingParams(max_tokens=steps + 2 * ROWS, temperature=0.7, seed=row)
            if with_grammar:
                params = SamplingParams(
                    max_tokens=steps + 2 * ROWS,
                    temperature=0.7,
                    seed=row,
                    logits_processors=(timed_processor(engine.grammars.processor(grammar)),),
                )
            engine.submit(None, prompt, params, keep_cache=False)
        times: list[float] = []
        decoding = False  # the step before gave every row a token: this one is a pure decode step
        while engine.has_work():
            started = time.perf_counter()
            output = engine.step()
            elapsed = time.perf_counter() - started
            if decoding and len(output.deltas) == ROWS and len(times) < steps:
                times.append(elapsed)
            decoding = len(output.deltas) == ROWS
        mask_per_step = sum(mask_s[-ROWS * len(times) :]) / max(1, len(times)) if with_grammar else 0.0
        return statistics.median(times), mask_per_step

    plain, masked, mask = [], [], []
    for _ in range(rounds):
        plain.append(median_step(False)[0])
        step, per_step = median_step(True)
        masked.append(step)
        mask.append(per_step)
    engine.close()
    out = {
        "rows": ROWS,
        "prompt_tokens": len(prompt),
        "plain_step_ms": statistics.median(plain) * 1e3,
        "grammar_step_ms": statistics.median(masked) * 1e3,
        "mask_ms_per_step": statistics.median(mask) * 1e3,
    }
    out["step_ratio"] = out["grammar_step_ms"] / out["plain_step_ms"]
    out["mask_share_of_plain_step"] = out["mask_ms_per_step"] / out["plain_step_ms"]
    return out


def functions_of(schema: dict[str, Any]) -> dict[str, Any]:
    """A BFCL entry's functions: name -> parameter schema, from its properties (one function, or a
    parallel call's several), the branches of an anyOf (a choice of functions) or an array's items."""
    found: dict[str, Any] = dict(schema.get("properties", {}))
    for branch in schema.get("anyOf", []) + schema.get("oneOf", []):
        found.update(functions_of(branch))
    if isinstance(schema.get("items"), dict):
        found.update(functions_of(schema["items"]))
    return found


def bench_calls(limit: int, max_tokens: int) -> dict[str, Any]:
    import jsonschema
    from pydantic import ValidationError

    from engine.batch.engine import BlockPoolBatchEngine
    from engine.core.errors import InvalidRequestError
    from engine.models.load import load_model
    from producer.models import GenerationRequest
    from worker.jobs.payload import JobRejected
    from worker.requests.output_split import splitter_for
    from worker.requests.prompts import prompt_tokens
    from worker.requests.sampling import checked_sampling
    from worker.requests.tool_grammar import forced_tool_calls

    model, tokenizer = load_model()
    engine = BlockPoolBatchEngine(model, tokenizer, model_name="smollm2", pool_mb=1536, max_batch=ROWS)
    refused: list[str] = []
    waiting = []
    with gzip.open(CORPUS, "rt") as lines:
        entries = [entry for line in lines if (entry := json.loads(line))["subset"].startswith("BFCL")]
    spread = entries[:: max(1, len(entries) // limit)][:limit]  # every subset, in its share
    for entry in spread:
        functions = functions_of(entry["schema"])
        tools = [
            {"type": "function", "function": {"name": name, "parameters": schema}}
            for name, schema in functions.items()
        ]
        try:
            request = GenerationRequest.model_validate(
                {
                    "messages": [{"role": "user", "content": "Call the function that fits, with arguments."}],
                    "tools": tools,
                    "tool_choice": "required",
                    "parallel_tool_calls": "parallel" in entry["subset"],
                    "max_tokens": max_tokens,
                }
            )
            tokens = prompt_tokens(tokenizer, request)
            output = splitter_for(tokenizer, request, tokens)
            sampling = checked_sampling(request, engine.check, forced_tool_calls(tokenizer, request, output))
        except (ValidationError, JobRejected, InvalidRequestError) as exc:
            refused.append(f"{entry['id']}: {str(exc).splitlines()[0][:160]}")
            continue
        waiting.append((entry["id"], functions, tokens, output, sampling))
    counts = {"valid_calls": 0, "invalid_calls": 0, "rows_without_a_call": 0, "rows_cut_by_max_tokens": 0}
    invalid: list[str] = []
    running: dict[int, tuple[str, dict[str, Any], Any]] = {}
    started = time.perf_counter()
    while waiting or engine.has_work():
        while waiting and engine.admission(len(waiting[0][2]), max_tokens).verdict == "now":
            name, functions, tokens, output, sampling = waiting.pop(0)
            running[engine.submit(None, tokens, sampling, keep_cache=False)] = (name, functions, output)
        for completion in engine.step().completions:
            name, functions, output = running.pop(completion.uid)
            output.feed(completion.text)
            output.finish()
            if completion.finish_reason == "length":
                counts["rows_cut_by_max_tokens"] += 1
            if not output.tool_calls:
                counts["rows_without_a_call"] += 1
                invalid.append(f"{name}: no call in {completion.text[:120]!r}")
            for call in output.tool_calls:
                try:
                    jsonschema.validate(json.loads(call.function.arguments), functions[call.function.name])
                    counts["valid_calls"] += 1
                except (KeyError, ValueError, jsonschema.ValidationError) as exc:
                    counts["invalid_calls"] += 1
                    invalid.append(f"{name}: {call.function.name}: {str(exc)[:120]}")
    engine.close()
    return {
        "definitions": limit,
        "refused_with_reason": len(refused),
        "refused": refused[:20],
        **counts,
        "invalid": invalid[:20],
        "seconds": time.perf_counter() - started,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", choices=["step", "calls"], action="append")
    parser.add_argument("--calls", type=int, default=300, help="BFCL entries for --only calls")
    parser.add_argument("--call-tokens", type=int, default=160, help="max_tokens of a forced call")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of plain and grammar batches")
    parser.add_argument("--steps", type=int, default=24, help="decode steps timed per batch")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results/grammar.json")
    args = parser.parse_args()
    only = args.only or ["step", "calls"]
    ensure_fast_blas()
    results: dict[str, Any] = {}
    if "step" in only:
        results["step"] = bench_step(args.rounds, args.steps)
        print(json.dumps(results["step"], indent=1))
    if "calls" in only:
        if CORPUS.exists():
            results["calls"] = bench_calls(args.calls, args.call_tokens)
            print(json.dumps(results["calls"], indent=1))
        else:
            print(f"corpus not found at {CORPUS}: calls skipped")
    args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
