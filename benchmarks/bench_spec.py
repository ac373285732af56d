"""Speculative decoding (engine/batch/speculation.py: prompt lookup, or a draft model) on
agent-shaped work, on the builtin SmolLM2, greedy: kvrq with and without speculation and raw mlx-lm's
BatchGenerator in the same run, at 1, 4 and 16 rows.

Tasks: `tool_call`, a tool call whose arguments quote a file shown in the prompt; `forced_tool`, the
same call under a grammar (a JSON schema of the call, as tool_choice or response_format enforce it:
kvrq's rows are masked, and drafted positions too, while raw mlx-lm runs unconstrained); `code_edit`, a
function shown and rewritten with one change; `chat`, plain chat (the control: little to copy).
Decode tokens/s counts the tokens after every row's first one over the time after it (prefill is the
same work with or without drafts); `same` says whether the tokens with speculation equal those
without (greedy: they must). `--draft-model` adds a run with that draft model (`draft_*` columns).

Run: python benchmarks/bench_spec.py [--quick] [--rows 1,4,16] [--tasks tool_call,code_edit,chat]
[--max-tokens N] [--draft-model NAME|builtin-q4] [--out PATH] (re-execs itself with OpenBLAS on
Linux). Writes benchmarks/results/spec.json (or --out), prints a markdown table and a one-line summary.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import table  # noqa: E402
from engine.core.params import OutputGrammar, SamplingParams  # noqa: E402
from engine.cpu.blas import ensure_fast_blas  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "spec.json"
TASKS = ("tool_call", "forced_tool", "code_edit", "chat")
DRAFT_Q4 = "builtin-q4"


def source_file(i: int) -> str:
    """A small Python module, different for every row."""
    name = ["orders", "users", "invoices", "sensors", "tickets", "routes", "photos", "events"][i % 8]
    return f'''"""Helpers for {name} (#{i})."""

import json
from pathlib import Path

DATA = Path("data/{name}.json")


def load_{name}(path: Path = DATA) -> list[dict]:
    with path.open() as f:
        return json.load(f)


def count_{name}(items: list[dict], status: str = "open") -> int:
    return sum(1 for item in items if item.get("status") == status)


def save_{name}(items: list[dict], path: Path = DATA) -> None:
    path.write_text(json.dumps(items, indent=2))
'''


#: forced_tool's grammar: the write_file call as the tool_call prompt asks for it.
WRITE_FILE_CALL = {
    "type": "object",
    "properties": {
        "name": {"const": "write_file"},
        "arguments": {
            "type": "object",
            "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
            "required": ["path", "content"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}


def grammar(task: str) -> OutputGrammar | None:
    if task != "forced_tool":
        return None
    return OutputGrammar("json_schema", json.dumps(WRITE_FILE_CALL), "bench forced_tool")


def messages(task: str, i: int) -> list[dict[str, str]]:
    code = source_file(i)
    if task in ("tool_call", "forced_tool"):
        return [
            {
                "role": "system",
                "content": 'You call tools by answering with JSON only: {"name": TOOL, "arguments": {...}}. '
                "Tool write_file(path, content) writes a file.",
            },
            {
                "role": "user",
                "content": f"This is src/mod{i}.py:\n\n{code}\nCopy it unchanged to backup/mod{i}.py with "
                "write_file: answer with the tool call, the whole file in content.",
            },
        ]
    if task == "code_edit":
        return [
            {
                "role": "user",
                "content": f"Here is a file:\n\n```python\n{code}```\n\nRename DATA to DATA_PATH everywhere "
                "and show the whole file again.",
            }
        ]
    topics = ["the sea", "a mountain", "coffee", "a robot", "winter", "a library", "trains", "the moon"]
    return [{"role": "user", "content": f"Write a short story about {topics[i % 8]} (#{i})."}]


class Timeline:
    """Tokens counted after every row has its first one, and the time that took."""

    def __init__(self, rows: int) -> None:
        self.rows, self.started = rows, set[int]()
        self.decode_start: float | None = None
        self.decode_tokens = 0

    def token(self, uid: int) -> None:
        if self.decode_start is not None:
            self.decode_tokens += 1
            return
        self.started.add(uid)
        if len(self.started) == self.rows:
            self.decode_start = time.perf_counter()

    def rate(self) -> float:
        assert self.decode_start is not None
        return self.decode_tokens / (time.perf_counter() - self.decode_start)


def run_kvrq(
    model: Any,
    tokenizer: Any,
    prompts: list[list[int]],
    max_tokens: int,
    spec: bool,
    draft_model: Any = None,
    output_grammar: OutputGrammar | None = None,
) -> dict[str, Any]:
    from engine.batch.engine import BlockPoolBatchEngine

    engine = BlockPoolBatchEngine(
        model,
        tokenizer,
        model_name="smollm2-135m",
        max_batch=len(prompts),
        speculation=spec,
        draft_model=draft_model,
    )
    params = SamplingParams(max_tokens=max_tokens, stop_tokens=(), grammar=output_grammar)
    uids = [engine.submit(None, p, params, keep_cache=False) for p in prompts]
    timeline = Timeline(len(prompts))
    tokens: dict[int, list[int]] = {uid: [] for uid in uids}
    steps = 0
    while engine.has_work():
        out = engine.step()
        steps += 1
        for delta in out.deltas:
            timeline.token(delta.uid)
            tokens[delta.uid].append(delta.token)
    rate = timeline.rate()
    stats = engine.speculation.stats if engine.speculation is not None else None
    engine.close()
    return {
        "tok_s": rate,
        "tokens": [tokens[uid] for uid in uids],
        "steps": steps,
        "acceptance": None if stats is None else round(stats.acceptance, 3),
        "drafting_steps": 0 if stats is None else stats.steps,
    }


def run_raw(model: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    from mlx_lm.generate import BatchGenerator

    n = len(prompts)
    gen = BatchGenerator(model, completion_batch_size=n, prefill_batch_size=min(8, n), prefill_step_size=512)
    gen.insert(prompts, max_tokens=[max_tokens] * n)
    timeline = Timeline(n)
    live = n
    while live:
        for r in gen.next_generated():
            timeline.token(r.uid)
            live -= r.finish_reason is not None
    rate = timeline.rate()
    gen.close()
    return {"tok_s": rate}


def load_draft_model(name: str | None) -> Any:
    """`--draft-model`: a model name for load_model, or DRAFT_Q4 (the builtin with its Q4_1 weights
    kept: the same model, its argmax nearly always the fp32 one's, at another cost per token)."""
    from engine.models.load import BUILTIN_MODEL, load_model

    if name is None:
        return None
    if name == DRAFT_Q4:
        return load_model(BUILTIN_MODEL, dequantize=False)[0]
    return load_model(name)[0]


def bench(
    rows: list[int], tasks: list[str], max_tokens: int, repeat: int, draft_model: Any = None
) -> list[dict[str, Any]]:
    from engine.models.load import load_model

    model, tokenizer = load_model("smollm2-135m")
    out = []
    for task in tasks:
        for n in rows:
            prompts = [
                list(tokenizer.apply_chat_template(messages(task, i), add_generation_prompt=True))
                for i in range(n)
            ]
            task_grammar = grammar(task)
            runs: dict[str, Callable[[], dict[str, Any]]] = {
                "raw": lambda p=prompts: run_raw(model, p, max_tokens),  # type: ignore[misc]
                "off": lambda p=prompts, g=task_grammar: run_kvrq(  # type: ignore[misc]
                    model, tokenizer, p, max_tokens, False, output_grammar=g
                ),
                "on": lambda p=prompts, g=task_grammar: run_kvrq(  # type: ignore[misc]
                    model, tokenizer, p, max_tokens, True, output_grammar=g
                ),
            }
            if draft_model is not None:
                runs["draft"] = lambda p=prompts, g=task_grammar: run_kvrq(  # type: ignore[misc]
                    model, tokenizer, p, max_tokens, True, draft_model, g
                )
            best: dict[str, dict[str, Any]] = {}
            for _ in range(repeat):  # interleaved: the machine's noise hits all three alike
                for name, run in runs.items():
                    result = run()
                    if name not in best or result["tok_s"] > best[name]["tok_s"]:
                        best[name] = result
            on, off, raw = best["on"], best["off"], best["raw"]
            row = {
                "task": task,
                "rows": n,
                "prompt_tokens": round(sum(map(len, prompts)) / n),
                "raw_tok_s": round(raw["tok_s"], 1),
                "off_tok_s": round(off["tok_s"], 1),
                "on_tok_s": round(on["tok_s"], 1),
                "on_vs_off": round(on["tok_s"] / off["tok_s"], 2),
                "on_vs_raw": round(on["tok_s"] / raw["tok_s"], 2),
                "acceptance": on["acceptance"],
                "drafting_steps": f"{on['drafting_steps']}/{on['steps']}",
                "same": on["tokens"] == off["tokens"],
            }
            if draft_model is not None:
                draft = best["draft"]
                row["draft_tok_s"] = round(draft["tok_s"], 1)
                row["draft_vs_off"] = round(draft["tok_s"] / off["tok_s"], 2)
                row["draft_acceptance"] = draft["acceptance"]
                row["draft_steps"] = f"{draft['drafting_steps']}/{draft['steps']}"
                row["draft_same"] = draft["tokens"] == off["tokens"]
            print(row, flush=True)
            out.append(row)
    return out


def main() -> None:
    ensure_fast_blas()
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="64 tokens, one run each")
    parser.add_argument("--rows", default="1,4,16", help="batch sizes, comma-separated")
    parser.add_argument("--tasks", default=",".join(TASKS), help="tasks, comma-separated")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per row [128; quick 64]")
    parser.add_argument(
        "--draft-model",
        default=None,
        help=f"also run kvrq with this draft model (a model name, or {DRAFT_Q4}: the builtin's Q4_1 weights)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"JSON written [{RESULTS}]")
    args = parser.parse_args()
    max_tokens = args.max_tokens or (64 if args.quick else 128)
    rows = bench(
        [int(n) for n in args.rows.split(",")],
        args.tasks.split(","),
        max_tokens,
        1 if args.quick else 2,
        load_draft_model(args.draft_model),
    )
    print(table(rows), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2))
    print(summary(rows), flush=True)


def summary(rows: list[dict[str, Any]]) -> str:
    """One line: speculation on / off by task and rows (what benchmarks/device_check.sh shows)."""
    parts = [f"{r['task']}@{r['rows']} {r['on_vs_off']}x{'' if r['same'] else ' DIFFERENT'}" for r in rows]
    return "on/off decode tok/s: " + ", ".join(parts)


if __name__ == "__main__":
    main()
