"""The engine tests' tiny random models and byte tokenizer: benchmarks/tiny_models.py, which
bench_kv_quant.py shares (benchmarks import nothing from tests/)."""

from __future__ import annotations

from benchmarks.tiny_models import QUANTIZABLE, ByteTokenizer, model_config, save_model_folder, tiny_model

__all__ = ["QUANTIZABLE", "ByteTokenizer", "model_config", "save_model_folder", "tiny_model"]
