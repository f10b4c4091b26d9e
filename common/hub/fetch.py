"""Fetching a model's files from the Hugging Face Hub into its cache (huggingface_hub), one
downloader at a time per cache, with huggingface_hub's errors turned into one clear line.

huggingface_hub honours HF_HUB_OFFLINE (only the cache is read), HF_TOKEN, HF_HOME /
HF_HUB_CACHE and HF_ENDPOINT; a fetch of files already cached downloads nothing.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from common.hub import progress
from common.hub.errors import ModelSourceError
from common.hub.files import Need, first_patterns, weight_patterns
from common.hub.lock import download_lock, lock_path

log = logging.getLogger(__name__)

#: snapshot_download's signature, or a stand-in with the same keywords (tests).
DownloadFn = Callable[..., str]


@dataclass(frozen=True)
class HubModel:
    """A model on the Hub, and where and how to fetch it."""

    repo_id: str  # ORG/NAME
    revision: str  # branch, tag or commit hash; "" = the default branch
    cache_dir: str  # the Hub cache (absolute)
    token: str | None  # None: huggingface_hub's own (HF_TOKEN, the saved login)

    def describe(self) -> str:
        return f"{self.repo_id}" + (f" (revision {self.revision})" if self.revision else "")


def default_cache_dir() -> str:
    """huggingface_hub's cache: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def offline() -> bool:
    """Whether HF_HUB_OFFLINE forbids reaching the Hub."""
    import huggingface_hub

    return huggingface_hub.is_offline_mode()


def fetch(model: HubModel, need: Need, download: DownloadFn | None = None) -> str:
    """The local snapshot folder of ``model`` holding the files ``need`` names, downloaded
    unless cached, under the cache's lock for this model, revision and need. Raises
    ModelSourceError for a model, revision or file the Hub or the cache does not have."""
    download = download or _snapshot_download
    _log_through_root()
    purpose = "weights" if Need.WEIGHTS in need else "config"
    lock = lock_path(model.cache_dir, model.repo_id, model.revision, purpose)
    try:
        with download_lock(lock, model.describe()):
            folder = _fetch(download, model, first_patterns(need), [])
            if Need.WEIGHTS in need:
                allow, ignore = weight_patterns(folder)
                folder = _fetch(download, model, allow, ignore)
    except ModelSourceError:
        raise
    except Exception as e:  # every huggingface_hub failure becomes one line
        raise ModelSourceError(" ".join(explain(e, model).split())) from None  # one line
    return folder


def _fetch(download: DownloadFn, model: HubModel, allow: list[str], ignore: list[str]) -> str:
    log.info("fetching %s: %s", model.describe(), ", ".join(allow))
    return download(
        model.repo_id,
        revision=model.revision or None,
        cache_dir=model.cache_dir,
        token=model.token,
        allow_patterns=allow,
        ignore_patterns=ignore or None,
        tqdm_class=progress.progress_class(),
    )


def _log_through_root() -> None:
    """huggingface_hub gives its logger a stderr handler of its own when imported; its records
    go through the program's handlers (text or JSON, common.logs) instead, once each."""
    import huggingface_hub  # noqa: F401 - its import adds the handler

    hub_logger = logging.getLogger("huggingface_hub")
    for handler in list(hub_logger.handlers):
        hub_logger.removeHandler(handler)
    hub_logger.propagate = True


def _snapshot_download(repo_id: str, **kwargs: Any) -> str:
    from huggingface_hub import snapshot_download

    return snapshot_download(repo_id, **kwargs)


def explain(error: Exception, model: HubModel) -> str:
    """One line saying why ``model`` could not be fetched and what to do."""
    from huggingface_hub import errors

    name = model.repo_id
    if isinstance(error, errors.GatedRepoError):
        return (
            f"{name} is a gated model: accept its license at https://huggingface.co/{name} and "
            "give a token of that account (HF_TOKEN or --hf-token-file)"
        )
    if isinstance(error, errors.RepositoryNotFoundError):
        return (
            f"model {name} was not found on the Hub, nor as a local directory (a private model "
            "needs a token: HF_TOKEN or --hf-token-file)"
        )
    if isinstance(error, errors.RevisionNotFoundError):
        return f"revision {model.revision!r} does not exist in {name}"
    if isinstance(error, errors.HfHubHTTPError) and _status(error) == 401:
        return f"the Hub refused the token for {name}: check HF_TOKEN or --hf-token-file"
    if isinstance(error, errors.HFValidationError):
        return f"--model {name} is not a valid Hub model id: {error}"
    if isinstance(error, errors.LocalEntryNotFoundError):
        return _not_cached(model, error)
    if isinstance(error, OSError):
        return f"cannot fetch {model.describe()} into {model.cache_dir}: {error}"
    return f"cannot fetch {model.describe()}: {type(error).__name__}: {error}"


def _status(error: Exception) -> int:
    response = getattr(error, "response", None)
    return int(getattr(response, "status_code", 0) or 0)


def _not_cached(model: HubModel, error: Exception) -> str:
    """The model, revision or file is not in the cache and the Hub cannot be asked."""
    from huggingface_hub import errors
    from huggingface_hub.file_download import repo_folder_name

    storage = os.path.join(
        model.cache_dir, repo_folder_name(repo_id=model.repo_id, repo_type="model")
    )
    why = "offline mode is on (HF_HUB_OFFLINE=1)" if offline() else "the Hub cannot be reached"
    if isinstance(error, errors.IncompleteSnapshotError):
        return f"the cached copy of {model.describe()} is incomplete and {why}: {error}"
    if not os.path.isdir(storage):
        return (
            f"model {model.repo_id} is not in the Hub cache {model.cache_dir}, nor a local "
            f"directory, and {why}: fetch it once with network access, or point "
            "--download-dir (HF_HUB_CACHE) at a cache that holds it"
        )
    cached = _cached_revisions(storage)
    return (
        f"revision {model.revision or 'main'!r} of {model.repo_id} is not in the Hub cache "
        f"{model.cache_dir} (cached: {', '.join(cached) or 'none'}) and {why}"
    )


def _cached_revisions(storage: str) -> list[str]:
    """Branch or tag names and commit hashes the cache holds for one model."""
    refs_dir = os.path.join(storage, "refs")
    refs = []
    for root, _, names in os.walk(refs_dir):
        refs += [os.path.relpath(os.path.join(root, n), refs_dir) for n in names]
    snapshots = os.path.join(storage, "snapshots")
    commits = sorted(os.listdir(snapshots)) if os.path.isdir(snapshots) else []
    return sorted(refs) + commits
