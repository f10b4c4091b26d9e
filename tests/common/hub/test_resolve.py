"""Resolving --model against a Hub-layout cache in offline mode (the real huggingface_hub
code), by id and by revision, and the errors of what is missing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from common.host.settings import ExecutorConfig
from common.hub import fetch
from common.hub.errors import ModelSourceError
from common.hub.files import CONTROLLER, EXECUTOR, Need
from common.hub.resolve import localize, resolve_model
from controller.settings import ControllerConfig
from tests.common.hub.conftest import REPO
from tests.support.hub_cache import add_snapshot, checkpoint_files, edited_config
from tests.support.processes import ROOT, model_dir


def _config(cache, **kw) -> ControllerConfig:
    return ControllerConfig(model=kw.pop("model", REPO), download_dir=str(cache), **kw)


def test_by_id_the_main_snapshot(hub_cache):
    cache, commits = hub_cache
    resolved = resolve_model(_config(cache), EXECUTOR)
    assert resolved.hub and resolved.name == REPO
    assert resolved.path.endswith(f"snapshots/{commits['main']}")
    assert sorted(os.listdir(resolved.path)) == sorted(os.listdir(model_dir()))


@pytest.mark.parametrize("revision", ["main", "second"])
def test_by_revision(hub_cache, revision):
    cache, commits = hub_cache
    wanted = revision if revision == "main" else commits[revision]  # a branch, or a commit
    resolved = resolve_model(_config(cache, revision=wanted), CONTROLLER)
    assert resolved.path.endswith(f"snapshots/{commits[revision]}")
    config = json.loads(open(os.path.join(resolved.path, "config.json")).read())
    assert (config["max_position_embeddings"] == 1024) == (revision == "second")


def test_localize_makes_the_settings_local(hub_cache):
    cache, commits = hub_cache
    settings = localize(ExecutorConfig(model=REPO, download_dir=str(cache)), EXECUTOR)
    assert settings.model.endswith(commits["main"]) and settings.served_model_name == REPO
    named = ExecutorConfig(model=REPO, download_dir=str(cache), served_model_name="chat")
    assert localize(named, EXECUTOR).served_model_name == "chat"
    local = localize(ExecutorConfig(model=model_dir()), EXECUTOR)
    assert local.model == model_dir()
    assert local.served_model_name == os.path.basename(model_dir())


def test_the_controller_asks_only_for_config_and_tokenizer_files(hub_cache, monkeypatch):
    cache, _ = hub_cache
    asked: list[list[str]] = []
    real = fetch._snapshot_download

    def spy(repo_id, **kw):
        asked.append(kw["allow_patterns"])
        return real(repo_id, **kw)

    monkeypatch.setattr(fetch, "_snapshot_download", spy)
    resolve_model(_config(cache), CONTROLLER)
    (patterns,) = asked
    assert "config.json" in patterns and "tokenizer.json" in patterns
    assert not [p for p in patterns if "safetensors" in p or p.endswith((".bin", "*"))]


OPENED = """
import json, os, sys
cache = sys.argv[1]
opened = []
sys.addaudithook(lambda event, args: opened.append(str(args[0])) if event == "open" else None)
from common.hub.files import CONTROLLER
from common.hub.resolve import localize
from common.wire.model_config import load_model_geometry
from controller.settings import ControllerConfig
from controller.text.tokenizer import Tokenizer
config = localize(ControllerConfig(model=sys.argv[2], download_dir=cache), CONTROLLER)
Tokenizer.from_model_dir(config.model)
load_model_geometry(config.model)
print(json.dumps(sorted({os.path.basename(p) for p in opened if p.startswith(cache)})))
"""


def test_the_controller_opens_no_weights(hub_cache, tmp_path):
    """What the controller's startup opens in the cache (Python's open audit events), and a
    snapshot without any weights serves the controller all the same."""
    cache, _ = hub_cache
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    run = subprocess.run(
        [sys.executable, "-c", OPENED, str(cache), REPO],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    opened = json.loads(run.stdout.splitlines()[-1])
    assert "config.json" in opened and "tokenizer_config.json" in opened
    assert not [name for name in opened if name.endswith(".safetensors")], opened
    files = checkpoint_files(model_dir(), drop=("model.safetensors",))
    add_snapshot(cache, "tandemtest/no-weights", files, "main", branch="main")
    resolve_model(_config(cache, model="tandemtest/no-weights"), CONTROLLER)
    with pytest.raises(ModelSourceError, match="no .safetensors weights"):
        resolve_model(_config(cache, model="tandemtest/no-weights"), EXECUTOR)


@pytest.mark.parametrize(
    "model, revision, message",
    [
        (
            "tandemtest/missing",
            "",
            "model tandemtest/missing is not in the Hub cache .*offline mode is on",
        ),
        (REPO, "v2.0", "revision 'v2.0' of .* is not in the Hub cache .*cached: main, "),
        ("/nonexistent/models/x", "", "model directory /nonexistent/models/x does not exist"),
        ("org/name/extra", "", "neither a directory nor a Hub model id"),
    ],
)
def test_what_is_not_there(hub_cache, model, revision, message):
    cache, _ = hub_cache
    with pytest.raises(ModelSourceError, match=message):
        resolve_model(_config(cache, model=model, revision=revision), CONTROLLER)


def test_broken_checkpoints_in_the_cache(hub_cache, tmp_path):
    cache, _ = hub_cache
    files = checkpoint_files(model_dir(), drop=("config.json",))
    add_snapshot(cache, "tandemtest/no-config", files, "main", branch="main")
    with pytest.raises(ModelSourceError, match=r"no-config .*offline mode.* has no config.json"):
        resolve_model(_config(cache, model="tandemtest/no-config"), Need.CONFIG)
    odd = edited_config(model_dir(), tmp_path / "config.json", architectures=["OddForCausalLM"])
    add_snapshot(cache, "tandemtest/odd", {**files, "config.json": odd}, "main", branch="main")
    with pytest.raises(ModelSourceError, match=r"unsupported architecture \['OddForCausalLM'\]"):
        resolve_model(_config(cache, model="tandemtest/odd"), Need.CONFIG)


def test_token_file(hub_cache, tmp_path):
    cache, _ = hub_cache
    with pytest.raises(ModelSourceError, match="--hf-token-file .*No such file"):
        resolve_model(_config(cache, hf_token_file=str(tmp_path / "none")), CONTROLLER)
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ModelSourceError, match="is empty"):
        resolve_model(_config(cache, hf_token_file=str(tmp_path / "empty")), CONTROLLER)
    (tmp_path / "token").write_text("hf_abc\n")
    assert resolve_model(_config(cache, hf_token_file=str(tmp_path / "token")), CONTROLLER)
