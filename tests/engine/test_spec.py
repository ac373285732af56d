from __future__ import annotations

import pytest
from mlx_lm.models.cache import ArraysCache, CacheList, ChunkedKVCache, KVCache, QuantizedKVCache

from engine.core.errors import UnsupportedModelError
from engine.core.spec import LayerSpec, ModelCacheSpec
from engine.models.cache_layout import spec_from_model
from tests.engine.tiny import tiny_model


@pytest.mark.parametrize(
    ("arch", "n_kv_heads", "head_dim"),
    [("llama", 2, 16), ("qwen2", 2, 16), ("qwen3", 2, 16), ("mixtral", 2, 16)],
)
def test_full_attention_models(arch: str, n_kv_heads: int, head_dim: int) -> None:
    spec = spec_from_model(tiny_model(arch), arch)
    assert spec.n_layers == 2
    assert spec.layers == (LayerSpec("full"), LayerSpec("full"))
    assert (spec.n_kv_heads, spec.k_head_dim, spec.v_head_dim) == (n_kv_heads, head_dim, head_dim)
    assert spec.dtype == "float32"
    assert spec.block_tokens == 256
    assert spec.all_full_attention


def test_gemma3_mixes_sliding_and_global_layers() -> None:
    spec = spec_from_model(tiny_model("gemma3_text"), "gemma3")
    kinds = [layer.kind for layer in spec.layers]
    assert kinds == ["sliding", "sliding", "full", "sliding", "sliding", "full"]
    assert all(layer.window == 32 for layer in spec.layers if layer.kind == "sliding")
    assert (spec.n_kv_heads, spec.k_head_dim) == (1, 16)
    assert not spec.all_full_attention


@pytest.mark.slow
def test_builtin_model_spec(smollm2: tuple[object, object]) -> None:
    spec = spec_from_model(smollm2[0], "smollm2-135m")
    assert (spec.n_layers, spec.n_kv_heads, spec.k_head_dim, spec.v_head_dim) == (30, 3, 64, 64)
    assert spec.dtype == "float32"
    assert spec.bytes_per_block() == 30 * 3 * 128 * 4 * 256


def test_unsupported_cache_type_names_the_layer_and_the_reason() -> None:
    class QuantizedModel:
        layers = [object(), object()]

        def make_cache(self) -> list[object]:
            return [KVCache(), QuantizedKVCache()]

    with pytest.raises(UnsupportedModelError, match=r"layer 1 uses QuantizedKVCache: mlx-lm cannot batch it"):
        spec_from_model(QuantizedModel(), "quantized")


def test_cache_list_member_is_named() -> None:
    class ChunkedHybrid:
        layers = [object()]

        def make_cache(self) -> list[object]:
            return [CacheList(ArraysCache(size=2), ChunkedKVCache(64))]

    with pytest.raises(UnsupportedModelError, match="layer 0 member 1 uses ChunkedKVCache"):
        spec_from_model(ChunkedHybrid(), "chunked")


def test_fingerprint_changes_with_any_field() -> None:
    base = ModelCacheSpec("m", 2, (LayerSpec("full"),) * 2, 2, 16, 16, "float32")
    assert base.fingerprint() == ModelCacheSpec.from_dict(base.to_dict()).fingerprint()
    other = ModelCacheSpec("m", 2, (LayerSpec("full"),) * 2, 2, 16, 16, "float16")
    assert base.fingerprint() != other.fingerprint()
    assert (
        base.fingerprint()
        != ModelCacheSpec("m2", 2, (LayerSpec("full"),) * 2, 2, 16, 16, "float32").fingerprint()
    )
