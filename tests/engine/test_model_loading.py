from __future__ import annotations

from typing import Any

import pytest
from mlx_lm import generate

from engine.cpu.blas import blas_preload_env, find_openblas, openblas_loaded
from engine.models.load import load_model


def ask_capital(model: Any, tokenizer: Any) -> str:
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    return str(generate(model, tokenizer, prompt, max_tokens=12, verbose=False))


@pytest.mark.slow
def test_builtin_model_answers_paris(smollm2: tuple[Any, Any]) -> None:
    model, tokenizer = smollm2
    assert "Paris" in ask_capital(model, tokenizer)
    assert tokenizer.eos_token_ids == {2}
    assert tokenizer.decode(tokenizer.encode("Grüße, 2024!")) == "Grüße, 2024!"


@pytest.mark.slow
def test_builtin_model_quantized_path_answers_paris() -> None:
    """The path Metal users get: the GGUF's 4-bit weights kept quantized."""
    model, tokenizer = load_model("smollm2-135m", dequantize=False)
    assert "Paris" in ask_capital(model, tokenizer)


def test_tests_run_with_openblas_preloaded() -> None:
    if find_openblas() is None:
        pytest.skip("OpenBLAS is not installed here (apt-get install libopenblas0-pthread)")
    assert openblas_loaded(), "the conftest should have re-executed pytest with OpenBLAS preloaded"


def test_preload_env_is_idempotent() -> None:
    env = blas_preload_env({"PATH": "/bin"})
    assert blas_preload_env(env) == env
