"""The prompt lookup's drafts on agent-shaped answers, without a model: how many tokens a verify step
would yield if the model wrote exactly the answer given (each step takes the draft's matching prefix
and one token more, as a greedy row does). It isolates the drafter: what it proposes, not what a
forward costs (benchmarks/bench_spec.py measures that on the builtin model, which is too small to
quote a file inside a JSON string faithfully).

Answers: `write_file`, a tool call whose `content` is a file from the prompt, JSON-escaped;
`edit_numbered`, an edit call whose `old_string` / `new_string` quote a function the agent read as
numbered lines (Claude Code's Read); `raw_copy`, the same file written plainly in a code block (the
control: no escapes). Lookups: `latest` (an n-gram's latest occurrence only), `longest` (of its
latest occurrences, the one matching furthest back), `quoted` (that, and the context as quoted in a
JSON string: engine/batch/drafters.py, what the engine runs).

Run: python benchmarks/bench_lookup.py [--draft 15] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_spec import source_file  # noqa: E402
from benchmarks.common import RESULTS, table  # noqa: E402
from engine.batch import drafters  # noqa: E402
from engine.batch.drafters import NgramIndex  # noqa: E402


def numbered(text: str) -> str:
    """Lines as Claude Code's Read shows them: a right-aligned number and a tab."""
    return "".join(f"{i:6}\t{line}\n" for i, line in enumerate(text.splitlines(), 1))


def cases(i: int) -> dict[str, tuple[str, str]]:
    """Per answer: (the context's text, the answer's text)."""
    code = source_file(i)
    shown = f"This is src/mod{i}.py:\n\n{code}\nCopy it to backup/mod{i}.py.\n"
    write = {"name": "write_file", "arguments": {"path": f"backup/mod{i}.py", "content": code}}
    old = code[code.index("def count_") : code.index("def save_")]
    edit = {
        "name": "Edit",
        "arguments": {
            "file_path": f"src/mod{i}.py",
            "old_string": old,
            "new_string": old.replace('status: str = "open"', 'status: str = "closed"'),
        },
    }
    return {
        "write_file": (shown, json.dumps(write)),
        "edit_numbered": (
            f"Read src/mod{i}.py:\n{numbered(code)}\nRename the default status.\n",
            json.dumps(edit),
        ),
        "raw_copy": (shown, f"```python\n{code}```\n"),
    }


def steps(tokenizer: Any, context: list[int], answer: list[int], draft: int) -> int:
    """Verify steps a greedy row takes to write `answer` after `context` with this lookup."""
    index = NgramIndex(tokenizer)
    tokens, done, count = context + answer, len(context), 0
    while done < len(tokens):
        proposed = index.draft(tokens[:done], draft)
        kept = 0
        while kept < len(proposed) and done + kept < len(tokens) and proposed[kept] == tokens[done + kept]:
            kept += 1
        done += kept + 1
        count += 1
    return count


def bench(draft: int, files: int) -> list[dict[str, Any]]:
    from engine.models.load import load_model

    _, tokenizer = load_model("smollm2-135m")
    lookups: dict[str, tuple[int, Any]] = {
        "latest": (1, None),
        "longest": (8, None),
        "quoted": (8, tokenizer),
    }
    rows = []
    for name in cases(0):
        row: dict[str, Any] = {"answer": name}
        for lookup, (occurrences, view) in lookups.items():
            drafters.OCCURRENCES = occurrences
            written = taken = 0
            for i in range(files):
                context, answer = cases(i)[name]
                answer_tokens = list(tokenizer.encode(answer))
                written += len(answer_tokens)
                taken += steps(view, list(tokenizer.encode(context)), answer_tokens, draft)
            row[f"{lookup}_tokens_a_step"] = round(written / taken, 2)
        row["answer_tokens"] = round(written / files)
        rows.append(row)
        print(row, flush=True)
    drafters.OCCURRENCES = lookups["longest"][0]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--draft", type=int, default=15, help="draft tokens a step at most [15]")
    parser.add_argument("--files", type=int, default=8, help="files (answers) per case [8]")
    parser.add_argument("--out", type=Path, default=RESULTS / "lookup.json", help="JSON written")
    args = parser.parse_args()
    rows = bench(args.draft, args.files)
    print(table(rows), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
