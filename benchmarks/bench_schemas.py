"""Real-world JSON schemas as response_format: how many are refused, and whether an invalid answer can pass.

Reads the MaskBench corpus in place (../shared/data/jsonschemabench, never copied), a fixed-seed sample of
`--schemas` entries (0: all ~9,000). For each schema, the path a request takes:

1. the request's own check (producer.models.checked_json_schema: its metaschema, a 64 KiB size limit);
2. llguidance's compile for the builtin model's tokenizer, as kvrq did before (strict: any unimplemented
   keyword refused) and as it does now (engine/batch/json_schema.py: rewritten, lenient, oneOf as anyOf),
   with what the grammar leaves unenforced, counted by kind;
3. on the corpus's own labelled instances of each compiled schema: the mask, model-free (the instance's
   tokens, as json.dumps writes it, fed to the grammar's matcher: a valid instance it refuses is a mask
   error) and the final validation a finished answer gets (worker/requests/schema_check.py). The figure
   that must be 0: invalid instances that pass the grammar and are then reported valid.

Figures are counts (deterministic for a seed); compile, validation and per-token mask times (each
valid instance's tokens masked one by one, what a decode step pays a row) are from this machine.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import NAN, percentile  # noqa: E402

CORPUS = Path(__file__).resolve().parents[2] / "shared/data/jsonschemabench/maskbench-dev.jsonl.gz"


def sample(limit: int, seed: int) -> list[dict[str, Any]]:
    with gzip.open(CORPUS, "rt") as lines:
        entries = [json.loads(line) for line in lines]
    if 0 < limit < len(entries):
        entries = [entries[i] for i in sorted(random.Random(seed).sample(range(len(entries)), limit))]
    return entries


def kind_of(unenforced: str) -> str:
    """A warning as a short kind: `Unimplemented keys: ["if", "then"]` -> `if, then`."""
    if unenforced.startswith("Unimplemented keys:"):
        listed = unenforced.split(":", 1)[1]
        return ", ".join(json.loads(listed[: listed.index("]") + 1]))
    if unenforced.startswith("oneOf"):
        return "oneOf"
    if unenforced.startswith("Unknown format"):
        return "format (unknown)"
    return unenforced.split(" (", 1)[0][:60]


def keywords(unenforced: Any) -> set[str]:
    """The single keywords (or other kinds) a list of unenforced lines names."""
    return {word for line in unenforced for word in kind_of(line.strip().splitlines()[0]).split(", ")}


def accepts(matcher: Any, tokens: list[int], mask: Any = None, mask_s: list[float] | None = None) -> bool:
    """Whether the grammar takes every token and may end there (the mask check, without a model).

    With `mask` (an llguidance token bitmask) and `mask_s`, each token's mask is computed first and
    timed: what a decode step pays per row under the grammar."""
    import llguidance.numpy as llnumpy

    for token in tokens:
        if mask is not None and mask_s is not None:
            started = time.perf_counter()
            llnumpy.fill_next_token_bitmask(matcher, mask, 0)
            mask_s.append(time.perf_counter() - started)
        if not matcher.consume_token(token):
            return False
    return bool(matcher.is_accepting())


def bench(entries: list[dict[str, Any]]) -> dict[str, Any]:
    import llguidance
    import llguidance.hf
    import llguidance.numpy as llnumpy

    from engine.batch.json_schema import compile_json_schema, grammar_text
    from engine.core.params import with_json_whitespace
    from engine.models.load import load_model
    from producer.models import checked_json_schema
    from worker.requests.schema_check import instance_violation

    _, tokenizer = load_model()
    lltokenizer = llguidance.hf.from_tokenizer(tokenizer._tokenizer)
    bitmask = llnumpy.allocate_token_bitmask(1, lltokenizer.vocab_size)
    counts: collections.Counter[str] = collections.Counter()
    request_refusals: collections.Counter[str] = collections.Counter()
    compile_refusals: collections.Counter[str] = collections.Counter()
    unenforced_kinds: collections.Counter[str] = collections.Counter()
    compile_s: list[float] = []
    validate_s: list[float] = []
    mask_s: list[float] = []
    for entry in entries:
        schema = entry["schema"]
        counts["schemas"] += 1
        try:
            checked_json_schema(schema)
        except ValueError as exc:
            counts["refused_by_request_check"] += 1
            request_refusals["size limit" if "bytes as JSON" in str(exc) else "metaschema"] += 1
            continue
        strict = llguidance.LLMatcher.grammar_from_json_schema(with_json_whitespace(schema))
        if llguidance.LLMatcher.validate_grammar(strict, lltokenizer):
            counts["refused_before_strict"] += 1
        started = time.perf_counter()
        try:
            compiled = compile_json_schema(schema, lltokenizer)
        except ValueError as exc:
            counts["refused_by_grammar"] += 1
            compile_refusals[str(exc)[:50]] += 1
            continue
        finally:
            compile_s.append(time.perf_counter() - started)
        counts["compiled"] += 1
        failed, as_sent = llguidance.LLMatcher.validate_grammar_with_warnings(grammar_text(schema), None)
        if not failed and keywords(as_sent) - keywords(compiled.unenforced):
            counts["more_enforced_by_rewrite"] += 1
        counts["fully_enforced" if not compiled.unenforced else "partly_enforced"] += 1
        unenforced_kinds.update({kind_of(item) for item in compiled.unenforced})
        source = json.dumps(schema, sort_keys=True, separators=(",", ":"))
        for test in entry.get("tests", []):
            label = "valid" if test["valid"] else "invalid"
            text = json.dumps(test["data"], ensure_ascii=False)
            tokens = tokenizer.encode(text, add_special_tokens=False)
            matcher = llguidance.LLMatcher(lltokenizer, compiled.grammar)
            passes_mask = accepts(matcher, tokens, bitmask if test["valid"] else None, mask_s)
            started = time.perf_counter()
            reported_valid = instance_violation(source, test["data"]) is None
            validate_s.append(time.perf_counter() - started)
            counts[f"{label}_instances"] += 1
            counts[f"{label}_refused_by_mask"] += not passes_mask
            if test["valid"] and not passes_mask and not failed:  # the rewrite's fault, or llguidance's?
                as_sent_grammar = llguidance.LLMatcher(lltokenizer, grammar_text(schema))
                counts["valid_refused_only_after_rewrite"] += accepts(as_sent_grammar, tokens)
            counts[f"{label}_reported_valid"] += reported_valid
            counts[f"{label}_passed_mask_and_reported_valid"] += passes_mask and reported_valid
    refused = counts["refused_by_request_check"] + counts["refused_by_grammar"]
    return {
        **counts,
        "refused_share": refused / counts["schemas"],
        "refused_before_share": (counts["refused_by_request_check"] + counts["refused_before_strict"])
        / counts["schemas"],
        "request_refusals": dict(request_refusals.most_common()),
        "grammar_refusals": dict(compile_refusals.most_common(8)),
        "unenforced_kinds": dict(unenforced_kinds.most_common(12)),
        "compile_ms_p50": percentile(compile_s, 0.5, NAN) * 1e3,
        "compile_ms_p99": percentile(compile_s, 0.99, NAN) * 1e3,
        "validate_ms_p50": percentile(validate_s, 0.5, NAN) * 1e3,
        "validate_ms_p99": percentile(validate_s, 0.99, NAN) * 1e3,
        "validate_ms_mean": statistics.fmean(validate_s) * 1e3 if validate_s else float("nan"),
        "mask_us_p50": percentile(mask_s, 0.5, NAN) * 1e6,
        "mask_us_p99": percentile(mask_s, 0.99, NAN) * 1e6,
        "mask_us_mean": statistics.fmean(mask_s) * 1e6 if mask_s else float("nan"),
        "mask_tokens": len(mask_s),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--schemas", type=int, default=2000, help="schemas sampled (0: the whole corpus)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results/schemas.json")
    args = parser.parse_args()
    started = time.perf_counter()
    results = bench(sample(args.schemas, args.seed))
    results["seconds"] = time.perf_counter() - started
    print(json.dumps(results, indent=1))
    args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
