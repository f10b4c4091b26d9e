"""Which files of a checkpoint each program reads, and whether a checkpoint has them.

The controller reads the config, the generation config and the tokenizer with its chat
templates; executors read the config and the safetensors weights (the shards an index lists,
else the top-level *.safetensors files: never .bin, .pth, .gguf, ONNX or consolidated.*
duplicates of the same weights); the simulator reads the config alone.
"""

from __future__ import annotations

import enum
import glob
import json
import os

from common.hub.errors import ModelSourceError
from common.wire.model_config import architecture_of

INDEX = "model.safetensors.index.json"  # the shard list of a sharded checkpoint
CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "additional_chat_templates/*.jinja",
)
# Weights in formats Tandem does not load, named in the error when no safetensors exist.
_OTHER_WEIGHTS = ("*.bin", "*.pth", "*.pt", "*.gguf", "*.msgpack", "*.h5")


class Need(enum.Flag):
    """What a program reads from the checkpoint."""

    CONFIG = enum.auto()  # config.json (+ generation_config.json): every program
    TOKENIZER = enum.auto()  # tokenizer files and chat templates: the controller
    WEIGHTS = enum.auto()  # safetensors weights: executors that load them


CONTROLLER = Need.CONFIG | Need.TOKENIZER
EXECUTOR = Need.CONFIG | Need.WEIGHTS


def first_patterns(need: Need) -> list[str]:
    """Hub file patterns of the first fetch: the small files, and the weights' index."""
    patterns = list(CONFIG_FILES)
    if Need.TOKENIZER in need:
        patterns += TOKENIZER_FILES
    if Need.WEIGHTS in need:
        patterns.append(INDEX)
    return patterns


def weight_patterns(folder: str) -> tuple[list[str], list[str]]:
    """Hub (allow, ignore) patterns of the weights, once the first fetch is in ``folder``:
    the shards its index lists, else the top-level safetensors files (subfolders hold other
    formats; consolidated.* is Mistral's own layout of the same weights)."""
    index = os.path.join(folder, INDEX)
    if os.path.isfile(index):
        return sorted(set(_read_index(index).values())), []
    return ["*.safetensors"], ["*/*", "consolidated*.safetensors"]


def _read_index(index: str) -> dict[str, str]:
    try:
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelSourceError(f"{index} is not a safetensors index: {e}") from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelSourceError(f"{index} lists no weights")
    return weight_map


def check_checkpoint(folder: str, need: Need, where: str) -> None:
    """Raise ModelSourceError naming the first file ``need`` requires that ``folder`` lacks,
    or an architecture Tandem does not serve. ``where`` names the model in the message."""
    config = _read_config(folder, where)
    try:
        architecture_of(config)
    except ValueError as e:
        raise ModelSourceError(f"{where}: {e}") from None
    if Need.WEIGHTS in need:
        _check_weights(folder, where)
    if Need.TOKENIZER in need and not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        raise ModelSourceError(
            f"{where} has no tokenizer.json: the controller reads the fast tokenizer's file "
            "(transformers' AutoTokenizer(...).save_pretrained writes it)"
        )


def _read_config(folder: str, where: str) -> dict:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise ModelSourceError(f"{where} has no config.json: it is not a Hugging Face checkpoint")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ModelSourceError(f"{where}: config.json cannot be read: {e}") from None
    if not isinstance(config, dict):
        raise ModelSourceError(f"{where}: config.json is not a JSON object")
    return config


def _check_weights(folder: str, where: str) -> None:
    index = os.path.join(folder, INDEX)
    if os.path.isfile(index):
        shards = sorted(set(_read_index(index).values()))
        missing = [s for s in shards if not os.path.isfile(os.path.join(folder, s))]
        if missing:
            raise ModelSourceError(
                f"{where} lacks {len(missing)} of the {len(shards)} weight files its {INDEX} "
                f"lists, e.g. {missing[0]}"
            )
        return
    if glob.glob(os.path.join(folder, "*.safetensors")):
        return
    others = sorted(
        os.path.basename(p) for pattern in _OTHER_WEIGHTS for p in glob.glob(f"{folder}/{pattern}")
    )
    found = f" (it has {', '.join(others[:3])}: Tandem loads safetensors only)" if others else ""
    raise ModelSourceError(f"{where} has no .safetensors weights{found}")
