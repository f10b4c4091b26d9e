"""--model as a Hub id, end to end, against a Hub-layout cache in offline mode (these machines
reach no Hub): the real commands fail at once, in one line, for what is missing, and a
controller and a CPU executor started with the id serve what the directory serves."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.e2e.helpers import CHATS, PROMPTS
from tests.support.hub_cache import (
    add_snapshot,
    build_default_cache,
    checkpoint_files,
    edited_config,
)
from tests.support.processes import ROOT, start_server

REPO = "tandemtest/SmolLM2-135M-Instruct"
ERROR_SECONDS = 60  # a startup error comes before torch loads: seconds, even on a busy machine


@pytest.fixture(scope="module")
def hub_cache(default_model_dir, tmp_path_factory):
    """The default model as REPO (two revisions) and broken variants, each under its id."""
    cache = tmp_path_factory.mktemp("hub") / "cache"
    build_default_cache(cache, REPO, default_model_dir)
    files = checkpoint_files(default_model_dir)
    for name, drop in (("no-config", "config.json"), ("no-weights", "model.safetensors")):
        add_snapshot(
            cache, f"tandemtest/{name}", checkpoint_files(default_model_dir, (drop,)), "m", "main"
        )
    no_tok = checkpoint_files(default_model_dir, ("tokenizer.json",))
    add_snapshot(cache, "tandemtest/no-tokenizer", no_tok, "m", "main")
    odd = edited_config(
        default_model_dir, cache.parent / "odd" / "config.json", architectures=["OddForCausalLM"]
    )
    add_snapshot(cache, "tandemtest/odd", {**files, "config.json": odd}, "m", "main")
    return cache


def _offline_env(cache) -> dict[str, str]:
    return dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache), PYTHONUNBUFFERED="1")


@pytest.mark.parametrize(
    "command, message",
    [
        (
            ["controller", "--model", "tandemtest/missing"],
            "model tandemtest/missing is not in the Hub cache",
        ),
        (
            ["executor", "gpu", "--model", "tandemtest/missing"],
            "offline mode is on (HF_HUB_OFFLINE=1)",
        ),
        (
            ["executor", "tpu", "--model", "tandemtest/missing"],
            "model tandemtest/missing is not in",
        ),
        (
            ["executor", "gpu", "--model", REPO, "--revision", "v9"],
            f"revision 'v9' of {REPO} is not",
        ),
        (["controller", "--model", "tandemtest/no-config"], "has no config.json"),
        (["executor", "sim", "--model", "tandemtest/no-config"], "has no config.json"),
        (["executor", "gpu", "--model", "tandemtest/no-weights"], "has no .safetensors weights"),
        (["controller", "--model", "tandemtest/no-tokenizer"], "has no tokenizer.json"),
        (
            ["controller", "--model", "tandemtest/odd"],
            "unsupported architecture ['OddForCausalLM']; supported: [",
        ),
        (
            ["executor", "gpu", "--model", "/nonexistent/SmolLM2"],
            "model directory /nonexistent/SmolLM2 does not exist",
        ),
    ],
)
def test_startup_errors_are_one_line(hub_cache, command, message):
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "tandem", *command],
        cwd=ROOT,
        env=_offline_env(hub_cache),
        capture_output=True,
        text=True,
        timeout=ERROR_SECONDS * 2,
    )
    elapsed = time.monotonic() - started
    prog = "tandem " + " ".join(command[:2] if command[0] == "executor" else command[:1])
    last = run.stderr.strip().splitlines()[-1]
    assert run.returncode == 1, run.stderr
    assert last.startswith(f"{prog}: error: ") and message in last, run.stderr
    assert (
        "Traceback" not in run.stderr and sum("error:" in x for x in run.stderr.splitlines()) == 1
    )
    assert elapsed < ERROR_SECONDS


def test_a_hub_id_serves_what_its_directory_serves(server, hub_cache, tmp_path, monkeypatch):
    """A controller and a CPU executor started with --model ORG/NAME from the offline cache:
    the served name is the id, and greedy completions and chats equal the directory's."""
    for key, value in _offline_env(hub_cache).items():
        monkeypatch.setenv(key, value)
    hub = start_server(REPO, str(tmp_path), timeout=600)
    try:
        (model,) = hub.client().models.list().data
        assert model.id == REPO and model.model_extra["root"] == REPO
        for prompt in PROMPTS[:3]:
            want = server.client().completions.create(
                model=server.model_name, prompt=prompt, max_tokens=24, temperature=0
            )
            got = hub.client().completions.create(
                model=REPO, prompt=prompt, max_tokens=24, temperature=0
            )
            assert got.choices[0].text == want.choices[0].text
        want = server.client().chat.completions.create(
            model=server.model_name, messages=CHATS[0], max_tokens=24, temperature=0
        )
        got = hub.client().chat.completions.create(
            model=REPO, messages=CHATS[0], max_tokens=24, temperature=0
        )
        assert got.choices[0].message.content == want.choices[0].message.content
    finally:
        hub.stop()
    logs = (tmp_path / "executor0.log").read_text()
    assert "snapshots/" in logs and "Loading weights" in logs  # resolved, and progress logged
