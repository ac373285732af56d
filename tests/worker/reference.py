"""Reference answers: each request alone through BlockPoolBatchEngine, in a process with OpenBLAS.

Run as `python -m tests.worker.reference` with a JSON list of request dicts on stdin; prints a
JSON list of {"text", "token_ids"}. A subprocess because OpenBLAS must be preloaded at start.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from producer.models import GenerationRequest


def reference_results(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from engine.cpu.blas import blas_preload_env

    done = subprocess.run(
        [sys.executable, "-m", "tests.worker.reference"],
        input=json.dumps(requests).encode(),
        capture_output=True,
        env=blas_preload_env(dict(os.environ)),
        check=True,
        timeout=600,
    )
    return list(json.loads(done.stdout))


def main() -> None:
    from engine.batch.engine import BlockPoolBatchEngine
    from engine.models.load import load_model
    from worker.requests.prompts import prompt_tokens
    from worker.requests.sampling import sampling_of

    model, tokenizer = load_model("smollm2-135m")
    engine = BlockPoolBatchEngine(model, tokenizer, model_name="smollm2-135m", max_batch=4)
    out = []
    for raw in json.loads(sys.stdin.read()):
        request = GenerationRequest.model_validate(raw)
        engine.submit(None, prompt_tokens(tokenizer, request), sampling_of(request))
        completions = []
        while engine.has_work():
            completions += engine.step().completions
        out.append({"text": completions[0].text, "token_ids": completions[0].token_ids})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
