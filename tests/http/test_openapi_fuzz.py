"""`/openapi.json` is the contract of `kvrq serve`, held by schemathesis (a property-based API fuzzer) over
real sockets: redis-server, a real `kvrq worker` on a tiny random llama (SmolLM2's tokenizer and chat
template, so the worker's path is the builtin's, only faster) and `kvrq serve`. Every operation of the
document gets generated bodies, valid and invalid; the run must have 0 server errors, 0 answers off
the document (status, content type, body schema), and every 4xx in the API's error shape (the
document's 4XX schema is that shape).

The only change to the published document: max_tokens and its kin are bounded at 4 and required, so
fuzzed jobs stay short; examples per operation are bounded, so the run takes about a minute."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.http.test_integration import ServeProcess
from tests.http.test_tools import server

pytestmark = [pytest.mark.integration]
__all__ = ["server"]  # test_tools' stack (redis-server, kvrq worker on model_folder, kvrq serve), shared

CHECKS = [
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
]
EXAMPLES = 10
FUZZ_MAX_TOKENS = 4
GENERATION_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses")
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer llama with SmolLM2's tokenizer and chat template (test_tools' `server` runs it)."""
    import mlx.core as mx

    from engine.models.gguf_smollm2 import gguf_path
    from engine.models.gguf_tokenizer import tokenizer_from_gguf_metadata
    from tests.engine.tiny import model_config, save_model_folder, tiny_model

    folder = tmp_path_factory.mktemp("models") / "tiny-fuzz"
    loaded: Any = mx.load(str(gguf_path()), return_metadata=True)
    hf = tokenizer_from_gguf_metadata(loaded[1])._tokenizer
    hf.save_pretrained(str(folder))
    model = tiny_model("llama", vocab_size=len(hf), tie_word_embeddings=False)
    save_model_folder(model, model_config("llama", vocab_size=len(hf), tie_word_embeddings=False), folder)
    return folder


def short_jobs(document: dict[str, Any]) -> dict[str, Any]:
    """The document with every token bound at FUZZ_MAX_TOKENS and required where a body has one."""
    for schema in document["components"]["schemas"].values():
        properties = schema.get("properties", {})
        for name in TOKEN_FIELDS:
            if name in properties:
                properties[name] = {"type": "integer", "minimum": 1, "maximum": FUZZ_MAX_TOKENS}
        if "max_tokens" in properties or "max_output_tokens" in properties:
            needed = "max_output_tokens" if "max_output_tokens" in properties else "max_tokens"
            schema["required"] = sorted({*schema.get("required", []), needed})
    return document


def test_schemathesis_finds_no_server_error_and_no_answer_off_the_document(
    server: ServeProcess, tmp_path: Path
) -> None:
    document = short_jobs(httpx.get(f"{server.url}/openapi.json", timeout=10).json())
    path = tmp_path / "openapi.json"
    path.write_text(json.dumps(document))
    command = [
        *(sys.executable, "-m", "schemathesis.cli", "run", str(path), "--url", server.url),
        *("--checks", ",".join(CHECKS), "--max-examples", str(EXAMPLES), "--seed", "40"),
        *("--phases", "examples,fuzzing", "--workers", "2", "--request-timeout", "60"),
        *("--suppress-health-check", "all", "--no-color", "--warnings", "off"),
    ]
    run = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    report = run.stdout[-12000:] + run.stderr[-3000:]
    assert run.returncode == 0, f"{report}\n--- serve log ---\n{server.log()[-4000:]}"
    log = server.log()
    for route in GENERATION_ROUTES:  # jobs really ran on the worker: each route answered 200 at least once
        assert f'"POST {route} HTTP/1.1" 200' in log, f"no 200 from {route}\n{report}"
