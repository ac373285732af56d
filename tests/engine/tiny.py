"""The engine tests' tiny random models and byte tokenizer (benchmarks/tiny_models.py, which
bench_kv_quant.py shares: benchmarks import nothing from tests/), and `run_all`, which drains an engine."""

from __future__ import annotations

from benchmarks.tiny_models import QUANTIZABLE, ByteTokenizer, model_config, save_model_folder, tiny_model
from engine.batch.engine import BlockPoolBatchEngine
from engine.core.results import Completion

__all__ = ["QUANTIZABLE", "ByteTokenizer", "model_config", "run_all", "save_model_folder", "tiny_model"]


def run_all(engine: BlockPoolBatchEngine) -> dict[int, Completion]:
    """Step `engine` until it has no work: each request's completion by uid (a stuck engine fails)."""
    done: dict[int, Completion] = {}
    for _ in range(10_000):
        if not engine.has_work():
            return done
        for completion in engine.step().completions:
            done[completion.uid] = completion
    raise AssertionError("engine did not finish")
