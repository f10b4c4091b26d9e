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
}


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
    )
