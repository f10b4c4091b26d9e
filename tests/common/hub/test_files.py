"""Which files each program fetches from a Hub repository, and the checkpoint checks."""

from __future__ import annotations

import json
import shutil

import pytest

from common.hub.errors import ModelSourceError
from common.hub.fetch import HubModel, fetch
from common.hub.files import CONTROLLER, EXECUTOR, Need, check_checkpoint
from tests.common.hub.fake_hub import (
    BIN_AND_SAFETENSORS_LISTING,
    MISTRAL_LISTING,
    SHARDS,
    SMOLLM2_LISTING,
    FakeHub,
)
from tests.support.processes import model_dir


def _fetch(tmp_path, listing, need):
    hub = FakeHub(listing)
    fetch(HubModel("org/model", "", str(tmp_path), None), need, download=hub)
    return sorted(hub.fetched)


def test_controller_fetches_config_and_tokenizer_only(tmp_path):
    assert _fetch(tmp_path, SMOLLM2_LISTING, CONTROLLER) == [
        "config.json",
        "generation_config.json",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


def test_executor_fetches_config_and_safetensors_only(tmp_path):
    # No ONNX, no training_args.bin, no tokenizer, no README.
    assert _fetch(tmp_path, SMOLLM2_LISTING, EXECUTOR) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    assert _fetch(tmp_path / "b", BIN_AND_SAFETENSORS_LISTING, EXECUTOR) == [
        "config.json",
        "model.safetensors",
    ]


def test_sharded_checkpoints_fetch_the_indexed_shards_not_consolidated(tmp_path):
    assert _fetch(tmp_path, MISTRAL_LISTING, EXECUTOR) == sorted(
        ["config.json", "generation_config.json", "model.safetensors.index.json", *SHARDS]
    )


def test_simulator_fetches_the_config_alone(tmp_path):
    assert _fetch(tmp_path, MISTRAL_LISTING, Need.CONFIG) == [
        "config.json",
        "generation_config.json",
    ]


def test_a_second_fetch_downloads_nothing(tmp_path):
    assert _fetch(tmp_path, MISTRAL_LISTING, EXECUTOR)
    assert _fetch(tmp_path, MISTRAL_LISTING, EXECUTOR) == []


@pytest.fixture
def checkpoint(tmp_path):
    out = tmp_path / "ckpt"
    shutil.copytree(model_dir(), out, ignore=shutil.ignore_patterns("model.safetensors"))
    (out / "model.safetensors").write_bytes(b"")  # content is the loader's business
    return out


def test_a_complete_checkpoint_passes(checkpoint):
    check_checkpoint(str(checkpoint), CONTROLLER | EXECUTOR, "here")


def test_missing_config(checkpoint):
    (checkpoint / "config.json").unlink()
    with pytest.raises(ModelSourceError, match="here has no config.json"):
        check_checkpoint(str(checkpoint), Need.CONFIG, "here")


def test_unknown_architecture_lists_the_supported_ones(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    config["architectures"] = ["FancyNewForCausalLM"]
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelSourceError) as err:
        check_checkpoint(str(checkpoint), Need.CONFIG, "here")
    assert "FancyNewForCausalLM" in str(err.value) and "LlamaForCausalLM" in str(err.value)


def test_missing_weights_name_the_formats_found(checkpoint):
    (checkpoint / "model.safetensors").unlink()
    check_checkpoint(str(checkpoint), CONTROLLER, "here")  # the controller needs none
    (checkpoint / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelSourceError) as err:
        check_checkpoint(str(checkpoint), EXECUTOR, "here")
    assert "here has no .safetensors weights" in str(err.value)
    assert "pytorch_model.bin: Tandem loads safetensors only" in str(err.value)


def test_missing_shard(checkpoint):
    (checkpoint / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model.safetensors", "b": "model-2.safetensors"}})
    )
    with pytest.raises(ModelSourceError, match="lacks 1 of the 2 weight files.*model-2"):
        check_checkpoint(str(checkpoint), EXECUTOR, "here")


def test_missing_tokenizer(checkpoint):
    (checkpoint / "tokenizer.json").unlink()
    check_checkpoint(str(checkpoint), EXECUTOR, "here")  # executors need none
    with pytest.raises(ModelSourceError, match="here has no tokenizer.json"):
        check_checkpoint(str(checkpoint), CONTROLLER, "here")


def _hub_error(cls, status: int):
    import httpx2

    request = httpx2.Request("GET", "https://huggingface.co/api/models/org/model")
    return cls("from the Hub", response=httpx2.Response(status, request=request))


@pytest.mark.parametrize(
    "error, message",
    [
        (
            ("GatedRepoError", 403),
            "org/model is a gated model: accept its license at https://huggingface.co/org/model "
            "and give a token of that account (HF_TOKEN or --hf-token-file)",
        ),
        (
            ("RepositoryNotFoundError", 404),
            "model org/model was not found on the Hub, nor as a local directory (a private "
            "model needs a token: HF_TOKEN or --hf-token-file)",
        ),
        (("RevisionNotFoundError", 404), "revision 'v9' does not exist in org/model"),
        (
            ("HfHubHTTPError", 401),
            "the Hub refused the token for org/model: check HF_TOKEN or --hf-token-file",
        ),
    ],
)
def test_what_the_hub_answers_becomes_one_line(tmp_path, error, message):
    """The Hub's refusals (made here: this machine reaches no Hub) as fetch reports them."""
    from huggingface_hub import errors

    raised = _hub_error(getattr(errors, error[0]), error[1])

    def download(repo_id, **kw):
        raise raised

    with pytest.raises(ModelSourceError) as err:
        fetch(HubModel("org/model", "v9", str(tmp_path), None), EXECUTOR, download=download)
    assert str(err.value) == message


def test_a_full_disk_names_the_cache(tmp_path):
    def download(repo_id, **kw):
        raise OSError(28, "No space left on device")

    with pytest.raises(ModelSourceError, match=f"into {tmp_path}: .*No space left"):
        fetch(HubModel("org/model", "", str(tmp_path), None), EXECUTOR, download=download)
