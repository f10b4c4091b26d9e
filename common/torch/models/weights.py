"""Loading safetensors checkpoints into a model by parameter name.

A checkpoint is either one ``model.safetensors``, a sharded set listed by
``model.safetensors.index.json``, or (fallback) every ``*.safetensors`` file in the directory.
Checkpoint names map onto the model's parameters directly, except the tensors the model fuses
(listed in its ``stacked_params``), which go to their shard of the fused parameter, and modules
that store a parameter differently from the checkpoint (they provide ``load_tensor``).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open
from torch import nn

from common.hub.progress import progress_bar

log = logging.getLogger(__name__)

#: Checkpoint tensors that are derived buffers, not parameters.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_files(model_dir: str) -> list[str]:
    """The safetensors files of a model directory, in a stable order."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(single):
        return [single]
    found = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if not found:
        raise FileNotFoundError(f"no .safetensors weights in {model_dir}")
    return [os.path.join(model_dir, n) for n in found]


def iterate_checkpoint(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, CPU tensor) for every tensor of the checkpoint, showing the bytes read
    (a bar on a terminal, else a log line every few seconds)."""
    files = checkpoint_files(model_dir)
    sizes = [os.path.getsize(p) for p in files]
    with progress_bar(sum(sizes), "Loading weights") as bar:
        for path, size in zip(files, sizes):
            done = 0
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    tensor = f.get_tensor(name)
                    bar.update(tensor.nbytes)
                    done += tensor.nbytes
                    yield name, tensor
            bar.update(size - done)  # the file's header


def load_weights(model: nn.Module, model_dir: str, dtype: torch.dtype) -> int:
    """Copy the checkpoint into ``model``'s (already allocated) parameters, cast to ``dtype``.

    A module with a ``load_tensor(param, tensor, shard)`` method (fused or re-laid-out
    layers) receives its checkpoint tensors through it; other parameters are copied as they
    are. A missing ``lm_head.weight`` is fine when the model ties it to the embeddings. Raises
    if any parameter (or shard) stays unfilled. Returns the number of checkpoint tensors used.
    """
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    stacked = getattr(model, "stacked_params", [])
    tied = getattr(getattr(model, "args", None), "tie_word_embeddings", False)
    filled: set[tuple[str, int]] = set()
    used = 0
    with torch.no_grad():
        for name, tensor in iterate_checkpoint(model_dir):
            if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and tied):
                continue
            target, shard = _resolve(name, stacked)
            module_name, _, param = target.rpartition(".")
            module = modules.get(module_name)
            if module is not None and hasattr(module, "load_tensor"):
                module.load_tensor(param, tensor.to(dtype), shard)
            elif target in params and shard == 0:
                if params[target].shape != tensor.shape:
                    raise ValueError(
                        f"{name}: checkpoint shape {tuple(tensor.shape)} != "
                        f"parameter {tuple(params[target].shape)}"
                    )
                params[target].data.copy_(tensor.to(dtype))
            else:
                log.warning("checkpoint tensor %s has no parameter; skipped", name)
                continue
            filled.add((target, shard))
            used += 1
    missing = [f"{n}[{s}]" for n, s in _expected(model, tied) if (n, s) not in filled]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} parameters, e.g. {missing[:5]}")
    return used


def _resolve(name: str, stacked: list[tuple[str, str, int]]) -> tuple[str, int]:
    """Model parameter name and shard index of a checkpoint tensor name."""
    for fused, part, shard in stacked:
        token = f".{part}."
        if token in name:
            return name.replace(token, f".{fused}."), shard
    return name, 0


def _expected(model: nn.Module, tied: bool) -> list[tuple[str, int]]:
    """Every (parameter, shard) the checkpoint must provide."""
    expected = []
    modules = dict(model.named_modules())
    for name, _ in model.named_parameters():
        if name == "lm_head.weight" and tied:
            continue
        module = modules.get(name.rpartition(".")[0])
        shards = len(getattr(module, "shard_sizes", [None]))
        expected += [(name, s) for s in range(shards)]
    return expected
