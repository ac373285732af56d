"""`kvrq worker --model PATH`: a real worker process on a local mlx-lm model folder.

The folder is written here the way `mlx_lm.convert` writes one: config.json, model.safetensors
(a tiny random llama, or qwen3_next: linear-attention layers whose state is checkpointed every
256 tokens) and the tokenizer files (the builtin SmolLM2 tokenizer, saved with
`save_pretrained`). The worker's answers must equal mlx-lm's own greedy decode of the same
folder, and an agent's second turn must resume from the first turn's cache.
"""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from engine.models.load import load_model
from producer.client import Producer
from producer.models import GenerationRequest
from tests.conftest import free_port
from tests.engine.tiny import model_config, save_model_folder, tiny_model
from tests.worker.procs import RedisProcess, WorkerProcess, exits_cleanly, module_redis
from worker.requests.prompts import prompt_tokens

pytestmark = [pytest.mark.integration, pytest.mark.slow]

VOCAB = 49152  # the builtin tokenizer's


@pytest.fixture(scope="module", params=["llama", "qwen3_next"])
def model_folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_folder(request.param, tmp_path_factory.mktemp("models"))


def write_model_folder(arch: str, parent: Path) -> Path:
    """A tiny random `arch` model with the builtin tokenizer, as an mlx-lm folder under `parent`."""
    from engine.models.gguf_smollm2 import gguf_path
    from engine.models.gguf_tokenizer import tokenizer_from_gguf_metadata

    folder = parent / f"tiny-{arch}"
    loaded: Any = mx.load(str(gguf_path()), return_metadata=True)
    tokenizer_from_gguf_metadata(loaded[1])._tokenizer.save_pretrained(str(folder))
    save_model_folder(tiny_model(arch, vocab_size=VOCAB), model_config(arch, vocab_size=VOCAB), folder)
    return folder


redis_proc = module_redis("local-model")


@pytest.fixture(scope="module")
def producer(
    redis_proc: RedisProcess, model_folder: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Producer]:
    worker = WorkerProcess(
        redis_proc.url,
        tmp_path_factory.mktemp("worker-local-model"),
        name=f"kvrq-local-{model_folder.name}",
        args=["--model", str(model_folder), "--max-batch", "4"],
    )
    with exits_cleanly(worker), Producer(redis_proc.url) as p:
        yield p


def greedy_reference(folder: Path, request: dict[str, Any]) -> list[int]:
    model, tokenizer = load_model(str(folder))
    prompt = prompt_tokens(tokenizer, GenerationRequest.model_validate(request))
    out = []
    steps = generate_step(
        mx.array(prompt), model, max_tokens=request["max_tokens"], sampler=lambda x: mx.argmax(x, axis=-1)
    )
    for token, _ in steps:
        if int(token) in tokenizer.eos_token_ids:
            break
        out.append(int(token))
    return out


def test_worker_on_a_local_folder_answers_like_mlx_lm_and_resumes(
    producer: Producer, model_folder: Path
) -> None:
    first: dict[str, Any] = {
        "agent_id": f"agent-{model_folder.name}",
        "messages": [{"role": "user", "content": "Tell me about the sea. " * 40}],  # ~300 tokens
        "max_tokens": 16,
    }
    result = producer.submit(first).result(timeout=300)
    assert result.token_ids == greedy_reference(model_folder, first)
    assert result.usage.reused_tokens == 0

    second = {
        **first,
        "messages": [
            *first["messages"],
            {"role": "assistant", "content": result.text},
            {"role": "user", "content": "And the mountains?"},
        ],
    }
    again = producer.submit(second).result(timeout=300)
    if model_folder.name == "tiny-qwen3_next":
        assert again.usage.reused_tokens == 256  # the checkpoint inside the shared first message
    else:
        assert again.usage.reused_tokens > result.usage.prompt_tokens - 8  # the first prompt, at least
    assert again.token_ids == greedy_reference(model_folder, second)


def test_a_worker_with_a_draft_model_times_it_answers_like_mlx_lm_and_exports_its_counts(
    redis_proc: RedisProcess, tmp_path: Path
) -> None:
    """`--draft-model` (the model drafts for itself here): the worker loads it and logs what a guess
    and a context token cost it, its answer is mlx-lm's greedy decode, and /metrics carries the
    drafting counters. Whether a step drafts is the cost's call (a model drafting for itself does not
    pay: at most a probe runs it), so the drafting itself is tests/engine/test_draft_model.py's."""
    folder = write_model_folder("llama", tmp_path)
    port = free_port()
    worker = WorkerProcess(
        redis_proc.url,
        tmp_path,
        name="kvrq-drafted",
        queue="drafted",
        args=["--model", str(folder), "--draft-model", str(folder), "--metrics-port", str(port)],
    )
    request: dict[str, Any] = {"messages": [{"role": "user", "content": "Tell me about the sea. " * 40}]}
    request["max_tokens"] = 24
    with exits_cleanly(worker), Producer(redis_proc.url, queue="drafted") as producer:
        result = producer.submit(request).result(timeout=300)
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert result.token_ids == greedy_reference(folder, request)
    assert re.search(rf"draft model {re.escape(str(folder))}: [0-9.]+ ms a guessed token", worker.log())
    counts = {
        name: float(match.group(1))
        for name in ("kvrq_draft_tokens_total", "kvrq_accepted_draft_tokens_total")
        if (match := re.search(rf'^{name}\{{worker="kvrq-drafted"\}} (\S+)$', metrics, re.M))
    }
    assert len(counts) == 2, metrics
    assert counts["kvrq_accepted_draft_tokens_total"] == counts["kvrq_draft_tokens_total"], "all accepted"


def test_a_path_that_is_not_a_model_folder_stops_the_worker_with_what_is_missing(
    redis_proc: RedisProcess, tmp_path: Path
) -> None:
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    worker = WorkerProcess(redis_proc.url, tmp_path, name="kvrq-bad-model", args=["--model", str(empty)])
    try:
        with pytest.raises(AssertionError, match="worker exited with 1"):
            worker.start(timeout=120)
    finally:
        worker.stop()
    assert "has no config.json, no *.safetensors weights, no tokenizer files" in worker.log()
