"""Model-source tests never reach the Hub: HF_HUB_OFFLINE=1 for this process and its
children, and the model in a Hub-layout cache built from the default model directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.hub_cache import build_default_cache
from tests.support.processes import model_dir

REPO = "tandemtest/SmolLM2-135M-Instruct"  # the id the cache holds the default model under


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # read once, at import


@pytest.fixture(scope="session")
def hub_cache(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """(cache folder, {"main": commit, "second": commit}) of the default model as REPO."""
    cache = tmp_path_factory.mktemp("hub") / "cache"
    return cache, build_default_cache(cache, REPO, model_dir())
