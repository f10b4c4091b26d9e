"""Which layers a checkpoint's config windows, as transformers reads it (no torch)."""

from __future__ import annotations

import pytest

from common.wire.model_config import architecture_of, layer_windows


def _cfg(model_type, n=6, **extra):
    return {"model_type": model_type, "num_hidden_layers": n, **extra}


def test_mistral_windows_every_layer_and_null_means_none():
    assert layer_windows(_cfg("mistral", 3, sliding_window=4096)) == [4096] * 3
    assert layer_windows(_cfg("mistral", 3, sliding_window=None)) == [0] * 3
    assert layer_windows(_cfg("llama", 3)) == [0] * 3


def test_qwen_windows_only_with_use_sliding_window():
    assert layer_windows(_cfg("qwen2", 4, sliding_window=4096)) == [0] * 4
    on = _cfg("qwen3", 4, sliding_window=64, use_sliding_window=True, max_window_layers=2)
    assert layer_windows(on) == [0, 0, 64, 64]


def test_layer_types_win_over_the_family_pattern():
    types = ["full_attention", "sliding_attention"] * 2
    cfg = _cfg("gemma2", 4, sliding_window=8, layer_types=types)
    assert layer_windows(cfg) == [0, 8, 0, 8]
    with pytest.raises(ValueError):
        layer_windows(_cfg("gemma2", 3, sliding_window=8, layer_types=types))


def test_gemma_patterns_without_layer_types():
    assert layer_windows(_cfg("gemma2", 4, sliding_window=8)) == [8, 0, 8, 0]
    assert layer_windows(_cfg("gemma3_text", 7, sliding_window=8)) == [8] * 5 + [0, 8]
    assert layer_windows(_cfg("gemma3_text", 4, sliding_window=8, sliding_window_pattern=2)) == [
        8,
        0,
        8,
        0,
    ]


def test_new_architectures_are_served():
    for arch in (
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
    ):
        assert architecture_of({"architectures": [arch]}) == arch
    with pytest.raises(ValueError, match="unsupported architecture"):
        architecture_of({"architectures": ["Gemma3ForConditionalGeneration"]})


def test_layer_windows_cross_the_wire_and_set_the_uniform_window():
    from common.wire import convert
    from common.wire.config import Capabilities, DeviceInfo, KVCacheSpec, ModelGeometry

    def info(windows):
        geometry = ModelGeometry("m", "MistralForCausalLM", 10, 3, 2, 16, 64, [2], windows)
        return DeviceInfo("i", "cpu", "cpu", geometry, KVCacheSpec(16, 1024, "f32"), Capabilities())

    for windows, uniform in (([], 0), ([8, 8, 8], 8), ([8, 0, 8], 0), ([8, 4, 8], 0)):
        back = convert.device_info_from_pb(convert.device_info_to_pb(info(windows))).model
        assert back.layer_windows == windows and back.uniform_window == uniform
