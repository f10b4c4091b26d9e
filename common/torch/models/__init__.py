"""The model families: checkpoint architecture -> model class, and building a loaded model.

Model classes are imported lazily when a model is built (the geometry, in
common.wire.model_config, needs no torch).
"""

from __future__ import annotations

import importlib
from typing import Any

from common.wire.model_config import ARCHITECTURES, architecture_of, read_model_config

#: Model family (common.wire.model_config.ARCHITECTURES) -> "module:Class".
_FAMILIES: dict[str, str] = {
    "llama": "common.torch.models.llama:LlamaForCausalLM",
    "qwen3": "common.torch.models.qwen3:Qwen3ForCausalLM",
    "qwen3_moe": "common.torch.models.qwen3_moe:Qwen3MoeForCausalLM",
    "mixtral": "common.torch.models.mixtral:MixtralForCausalLM",
    "gemma": "common.torch.models.gemma:GemmaForCausalLM",
}


def get_model_class(architecture: str) -> type:
    """The model class registered for ``architecture``."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {architecture!r}")
    module_name, class_name = _FAMILIES[ARCHITECTURES[architecture]].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def build_model(
    model_dir: str,
    dtype: Any,
    device: Any,
    max_model_len: int = 0,
    load_format: str = "auto",
    tp: Any = None,
) -> Any:
    """Create the checkpoint's model on ``device`` with ``dtype`` weights, loaded and in eval mode;
    with ``tp`` (common.torch.parallel.TensorParallel), this rank's shard of it.

    Parameters are first created on the meta device (no random init), then allocated on the
    target device and filled from the checkpoint, or, with ``load_format="dummy"``, with random
    values (norm weights 1, the rest N(0, 0.02^2), seeded): only config.json is read.
    """
    import torch

    from common.torch.models.weights import load_weights

    cfg = read_model_config(model_dir)
    cls = get_model_class(architecture_of(cfg))
    from common.torch.parallel import SINGLE

    with torch.device("meta"):
        model = cls(cfg, dtype=dtype, max_model_len=max_model_len, tp=tp or SINGLE)
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
