"""Model registry: checkpoint architecture string -> model class, plus geometry and loading.

``load_model_geometry`` reads only JSON and does not import torch; model classes are imported
lazily when a model is built.
"""

from __future__ import annotations

import importlib
import json
import os
from typing import Any

from common.config import ModelGeometry

#: Architecture string (config.json "architectures") -> "module:Class".
_REGISTRY: dict[str, str] = {
    "LlamaForCausalLM": "common.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "common.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "common.models.llama:LlamaForCausalLM",
}


def supported_architectures() -> list[str]:
    """Architecture strings this project can serve."""
    return sorted(_REGISTRY)


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
        if arch in _REGISTRY:
            return arch
    raise ValueError(f"unsupported architecture {archs}; supported: {supported_architectures()}")


def get_model_class(architecture: str) -> type:
    """The model class registered for ``architecture``."""
    if architecture not in _REGISTRY:
        raise ValueError(f"unsupported architecture {architecture!r}")
    module_name, class_name = _REGISTRY[architecture].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def load_model_geometry(model_dir: str, max_model_len: int = 0,
                        served_name: str = "") -> ModelGeometry:
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
    )


def build_model(model_dir: str, dtype: Any, device: Any, max_model_len: int = 0,
                load_format: str = "auto") -> Any:
    """Create the checkpoint's model on ``device`` with ``dtype`` weights, loaded and in eval mode.

    Parameters are first created on the meta device (no random init), then allocated on the
    target device and filled from the checkpoint, or, with ``load_format="dummy"``, with random
    values (norm weights 1, the rest N(0, 0.02^2), seeded): only config.json is read.
    """
    import torch

    from common.models.weights import load_weights

    cfg = read_model_config(model_dir)
    cls = get_model_class(architecture_of(cfg))
    with torch.device("meta"):
        model = cls(cfg, dtype=dtype, max_model_len=max_model_len)
    model.to_empty(device=device)
    model.tie_weights()
    if load_format == "dummy":
        gen = torch.Generator(device=device).manual_seed(0)
        with torch.no_grad():
            for param in model.parameters():
                if param.dim() == 1:
                    param.fill_(1.0)
                else:
                    param.normal_(0.0, 0.02, generator=gen)
    elif load_format == "auto":
        load_weights(model, model_dir, dtype)
    else:
        raise ValueError(f"unknown load format {load_format!r} (auto, dummy)")
    model.post_load(device)
    return model.eval().requires_grad_(False)
