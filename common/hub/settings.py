"""The settings that say where the model comes from, shared by the controller and every
executor: each resolves the same reference (common.hub.resolve)."""

from __future__ import annotations

from common.settings import TandemSettings, setting

MODEL_SOURCE = "model source: a local directory or a Hugging Face Hub id"


class ModelSourceSettings(TandemSettings):
    """Where the model comes from: a local checkpoint directory, or a Hub id (ORG/NAME) that
    is fetched into the Hub's cache (HF_TOKEN, HF_HUB_OFFLINE and HF_HOME as huggingface_hub
    reads them)."""

    model: str = setting(
        help="local Hugging Face model directory, or a Hub model id (ORG/NAME)",
        metavar="PATH|ID",
        group=MODEL_SOURCE,
    )
    revision: str = setting(
        "",
        "Hub revision of a model id: a branch, tag or commit hash ('' = main); ignored for a "
        "local directory",
        group=MODEL_SOURCE,
    )
    download_dir: str = setting(
        "",
        "Hub cache directory ('' = huggingface_hub's: $HF_HUB_CACHE, else $HF_HOME/hub)",
        group=MODEL_SOURCE,
        metavar="PATH",
    )
    hf_token_file: str = setting(
        "",
        "file holding the Hub token for gated or private models ('' = $HF_TOKEN, else the "
        "token `hf auth login` saved)",
        group=MODEL_SOURCE,
        metavar="PATH",
    )
