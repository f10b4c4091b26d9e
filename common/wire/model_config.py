"""Model geometry from a checkpoint's config.json: the architectures Tandem serves and the shape
facts the controller needs. Reads JSON only (no torch)."""

from __future__ import annotations

import json
import os
from typing import Any

from common.wire.config import ModelGeometry

#: Architecture string (config.json "architectures") -> the model family that implements it
#: (common.torch.models maps each family to its class).
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Gemma2ForCausalLM": "gemma",
    "Gemma3ForCausalLM": "gemma",
}

#: Families whose configs gate the window with ``use_sliding_window`` and, without
#: ``layer_types``, window only the layers from ``max_window_layers`` on.
_QWEN_TYPES = ("qwen2", "qwen3", "qwen3_moe")
#: Without ``layer_types``: every n-th layer attends globally, the others are windowed.
_GLOBAL_EVERY = {"gemma2": 2, "gemma3_text": 6, "gemma3": 6}


def supported_architectures() -> list[str]:
    """Architecture strings this project can serve."""
    return sorted(ARCHITECTURES)


def read_model_config(model_dir: str) -> dict[str, Any]:
    """The checkpoint's config.json as a dict."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{model_dir} has no config.json")
    with open(path) as f:
        return json.load(f)


def architecture_of(cfg: dict[str, Any]) -> str:
    """The first supported architecture listed in a config dict; raises if none is."""
    archs = cfg.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return arch
    raise ValueError(f"unsupported architecture {archs}; supported: {supported_architectures()}")


def layer_windows(cfg: dict[str, Any]) -> list[int]:
    """Per decoder layer, its sliding window in tokens (0: it attends to the whole context), as
    transformers reads the config: ``layer_types`` where given ("sliding_attention" layers take
    ``sliding_window``), else the family's pattern; ``sliding_window`` null means none."""
    n = int(cfg["num_hidden_layers"])
    window = int(cfg.get("sliding_window") or 0)
    model_type = cfg.get("model_type", "")
    if model_type in _QWEN_TYPES and not cfg.get("use_sliding_window", False):
        window = 0
    if window <= 0:
        return [0] * n
    types = cfg.get("layer_types")
    if types:
        if len(types) != n:
            raise ValueError(f"layer_types lists {len(types)} layers; the model has {n}")
        return [window if t == "sliding_attention" else 0 for t in types]
    if model_type in _QWEN_TYPES:
        first = int(cfg.get("max_window_layers", n))
        return [window if i >= first else 0 for i in range(n)]
    if model_type in _GLOBAL_EVERY:
        every = int(
            cfg.get("sliding_window_pattern")
            or cfg.get("_sliding_window_pattern")
            or _GLOBAL_EVERY[model_type]
        )
        return [0 if (i + 1) % every == 0 else window for i in range(n)]
    return [window] * n


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def load_model_geometry(
    model_dir: str, max_model_len: int = 0, served_name: str = ""
) -> ModelGeometry:
    """Shape facts of the checkpoint in ``model_dir``.

    ``max_model_len`` (0 = the model's own) caps the model's ``max_position_embeddings``. EOS ids
    come from config.json and generation_config.json (each an int or a list), deduplicated.
    """
    cfg = read_model_config(model_dir)
    arch = architecture_of(cfg)
    heads = cfg["num_attention_heads"]
    eos = _as_id_list(cfg.get("eos_token_id"))
    gen_path = os.path.join(model_dir, "generation_config.json")
    if os.path.exists(gen_path):
        with open(gen_path) as f:
            eos += _as_id_list(json.load(f).get("eos_token_id"))
    model_len = int(cfg.get("max_position_embeddings", 2048))
    if max_model_len > 0:
        model_len = min(model_len, max_model_len)
    return ModelGeometry(
        model_name=served_name or os.path.basename(os.path.normpath(model_dir)),
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        max_model_len=model_len,
        eos_token_ids=list(dict.fromkeys(eos)),
        layer_windows=windows if any(windows := layer_windows(cfg)) else [],
    )
