"""load_model: any mlx-lm model id or local model folder, or the builtin offline SmolLM2-135M.

A local folder is what `mlx_lm.convert` or `save_pretrained` writes: config.json, *.safetensors
weights and the tokenizer files. A name that points at the file system but is not such a folder
fails here with what is missing, instead of being sent to the Hugging Face hub as a model id.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.models.gguf_smollm2 import load_smollm2

BUILTIN_MODEL = "smollm2-135m"

log = logging.getLogger(__name__)


def on_cpu() -> bool:
    return bool(mx.default_device() == mx.cpu)


def load_model(name: str = BUILTIN_MODEL, *, dequantize: bool | None = None) -> tuple[nn.Module, Any]:
    """Return (model, tokenizer wrapper).

    `dequantize=None` picks the fast path for the device: on the CPU quantized
    matmuls are slow and do not batch, so weights become float32 there; on Metal or
    CUDA they stay quantized.
    """
    if dequantize is None:
        dequantize = on_cpu()
    if name == BUILTIN_MODEL:
        model, tokenizer = load_smollm2(dequantize=dequantize)
    else:
        from mlx_lm import load

        folder = local_model_folder(name)
        model, tokenizer = load(str(folder) if folder is not None else name)[:2]
        if dequantize and _is_quantized(model):
            from mlx_lm.utils import dequantize_model

            model = dequantize_model(model)
    return model, tokenizer


class ModelFolderError(ValueError):
    """A local path given as the model is not an mlx-lm model folder."""


def local_model_folder(name: str) -> Path | None:
    """The model folder `name` names, None for a hub id; ModelFolderError for a path that is not one."""
    path = Path(os.path.expanduser(name))
    looks_local = path.exists() or name.startswith(("/", "./", "../", "~")) or name in (".", "..")
    if not looks_local:
        return None
    if not path.is_dir():
        raise ModelFolderError(f"model path {name!r} is not a folder (an mlx-lm model is a folder)")
    missing = [
        what
        for what, present in (
            ("config.json", (path / "config.json").is_file()),
            ("*.safetensors weights", any(path.glob("*.safetensors"))),
            ("tokenizer files (tokenizer.json or tokenizer.model)", _has_tokenizer(path)),
        )
        if not present
    ]
    if missing:
        raise ModelFolderError(f"model folder {str(path)!r} has no {', no '.join(missing)}")
    return path.resolve()


def _has_tokenizer(path: Path) -> bool:
    return any((path / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json"))


def _is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding) for _, m in model.named_modules())
