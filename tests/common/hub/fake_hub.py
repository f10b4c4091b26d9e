"""A stand-in for huggingface_hub's snapshot_download over a made-up repository listing: it
selects files with huggingface_hub's own pattern filter and writes them into a Hub-layout
cache as the real one does (a file already there is not fetched again), optionally slowly,
recording every file it "downloads"."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from huggingface_hub.utils import filter_repo_objects

from tests.support.processes import model_dir

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def config_bytes() -> bytes:
    return (Path(model_dir()) / "config.json").read_bytes()


def index_bytes(shards: list[str]) -> bytes:
    weight_map = {f"layer{i}.weight": shard for i, shard in enumerate(shards)}
    return json.dumps({"metadata": {}, "weight_map": weight_map}).encode()


# What real repositories hold (abridged): extra formats and folders beside the checkpoint.
SMOLLM2_LISTING = [
    ".gitattributes",
    "README.md",
    "config.json",
    "generation_config.json",
    "merges.txt",
    "model.safetensors",
    "onnx/model.onnx",
    "onnx/model_q4.onnx",
    "runs/Nov01_12-00-00/events.out.tfevents",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "training_args.bin",
    "vocab.json",
]
SHARDS = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
MISTRAL_LISTING = [
    "config.json",
    "consolidated.safetensors",
    "generation_config.json",
    *SHARDS,
    "model.safetensors.index.json",
    "params.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
]
BIN_AND_SAFETENSORS_LISTING = [
    "config.json",
    "model.safetensors",
    "pytorch_model.bin",
    "tf_model.h5",
    "tokenizer.json",
]


class FakeHub:
    """snapshot_download's keywords over ``listing``; ``fetched`` lists every file written."""

    def __init__(self, listing: list[str], delay: float = 0.0, record: str = ""):
        self.listing = listing  # the repository's files
        self.delay = delay  # seconds each file takes to "download"
        self.record = record  # a file to append "pid name" to per download (other processes)
        self.fetched: list[str] = []  # files this instance wrote
        self.calls: list[list[str]] = []  # the allow patterns of each call

    def content(self, name: str) -> bytes:
        if name == "config.json":
            return config_bytes()
        if name == "model.safetensors.index.json":
            return index_bytes(SHARDS)
        return f"contents of {name}".encode()

    def __call__(self, repo_id, *, revision, cache_dir, token, allow_patterns, **kw) -> str:
        self.calls.append(list(allow_patterns))
        names = filter_repo_objects(
            self.listing, allow_patterns=allow_patterns, ignore_patterns=kw["ignore_patterns"]
        )
        folder = os.path.join(cache_dir, "models--" + repo_id.replace("/", "--"))
        snapshot = os.path.join(folder, "snapshots", COMMIT)
        for name in names:
            path = os.path.join(snapshot, name)
            if os.path.exists(path):
                continue
            time.sleep(self.delay)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path + ".part", "wb") as f:
                f.write(self.content(name))
            os.replace(path + ".part", path)
            self.fetched.append(name)
            if self.record:
                with open(self.record, "a") as f:
                    f.write(f"{os.getpid()} {name}\n")
        os.makedirs(os.path.join(folder, "refs"), exist_ok=True)
        with open(os.path.join(folder, "refs", revision or "main"), "w") as f:
            f.write(COMMIT)
        return snapshot


def fetch_in_process(cache: str, record: str, delay: float) -> None:
    """What each process of the lock test runs: fetch the Mistral-like repository's weights
    through the real fetch (and its lock) with a slow FakeHub; prints the snapshot folder."""
    import logging

    from common.hub.fetch import HubModel, fetch
    from common.hub.files import EXECUTOR

    logging.basicConfig(level=logging.INFO)
    hub = FakeHub(MISTRAL_LISTING, delay=delay, record=record)
    print(fetch(HubModel("org/sharded", "", cache, None), EXECUTOR, download=hub), flush=True)
