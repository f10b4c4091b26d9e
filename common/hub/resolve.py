"""Resolving a program's `--model` to a local checkpoint directory, at startup.

A local directory is used as it is; a Hub id is fetched into the Hub cache (only the files the
program reads: common.hub.files). Either way the directory is checked for those files and a
supported architecture, so that a bad model fails at once, in one line, rather than deep in
loading.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import NoReturn, TypeVar

from common.hub import fetch
from common.hub.errors import ModelSourceError
from common.hub.files import Need, check_checkpoint
from common.hub.reference import default_served_name, parse_reference
from common.hub.settings import ModelSourceSettings

log = logging.getLogger(__name__)

S = TypeVar("S", bound=ModelSourceSettings)
EXIT_MODEL_ERROR = 1  # the status of a program whose model cannot be served


@dataclass(frozen=True)
class ResolvedModel:
    """A model reference made local."""

    path: str  # the directory holding the checkpoint's files (a Hub cache snapshot, or as given)
    name: str  # the name clients use by default: the Hub id, or the directory's name
    hub: bool  # fetched through the Hub (else a local directory)


def read_token(path: str) -> str | None:
    """The Hub token in ``path`` (first line); None when no file is given."""
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            token = f.readline().strip()
    except OSError as e:
        raise ModelSourceError(f"--hf-token-file {path}: {e.strerror or e}") from None
    if not token:
        raise ModelSourceError(f"--hf-token-file {path} is empty")
    return token


def hub_model(settings: ModelSourceSettings) -> fetch.HubModel:
    """Where and how to fetch the Hub id ``settings.model``."""
    cache = settings.download_dir or fetch.default_cache_dir()
    return fetch.HubModel(
        repo_id=settings.model.strip(),
        revision=settings.revision.strip(),
        cache_dir=os.path.abspath(os.path.expanduser(cache)),
        token=read_token(settings.hf_token_file),
    )


def resolve_model(
    settings: ModelSourceSettings, need: Need, download: fetch.DownloadFn | None = None
) -> ResolvedModel:
    """The local directory of ``settings.model`` holding what ``need`` names (fetched from
    the Hub for an id; ``download`` replaces snapshot_download in tests). Raises
    ModelSourceError naming what is missing."""
    ref = parse_reference(settings.model)
    if ref.is_local:
        if not os.path.isdir(ref.path):
            raise ModelSourceError(f"model directory {ref.text} does not exist")
        check_checkpoint(ref.path, need, f"model directory {ref.text}")
        return ResolvedModel(ref.path, default_served_name(ref.text), hub=False)
    model = hub_model(settings)
    started = time.monotonic()
    folder = fetch.fetch(model, need, download)
    where = f"{model.describe()} (snapshot {folder})"
    if fetch.offline():
        where += " [offline mode: only cached files]"
    check_checkpoint(folder, need, where)
    log.info("%s is in %s (%.1fs)", model.describe(), folder, time.monotonic() - started)
    return ResolvedModel(folder, model.repo_id, hub=True)


def localize(settings: S, need: Need, download: fetch.DownloadFn | None = None) -> S:
    """A copy of ``settings`` whose model is the resolved local directory, and whose served
    name, when empty, is the reference's default (the Hub id or the directory's name)."""
    resolved = resolve_model(settings, need, download)
    update: dict[str, str] = {"model": resolved.path}
    if not getattr(settings, "served_model_name", "x"):
        update["served_model_name"] = resolved.name
    return settings.model_copy(update=update)


def localize_or_exit(settings: S, need: Need, prog: str) -> S:
    """``localize``, or one line on stderr and exit status EXIT_MODEL_ERROR when the model
    cannot be served (a startup error, not a crash: no traceback)."""
    try:
        return localize(settings, need)
    except ModelSourceError as e:
        _exit(settings, e, prog)


def resolve_or_exit(settings: ModelSourceSettings, need: Need, prog: str) -> ResolvedModel:
    """``resolve_model``, or one line on stderr and exit status EXIT_MODEL_ERROR."""
    try:
        return resolve_model(settings, need)
    except ModelSourceError as e:
        _exit(settings, e, prog)


def _exit(settings: ModelSourceSettings, error: ModelSourceError, prog: str) -> NoReturn:
    log.debug("model %s: %s", settings.model, error)
    print(f"{prog}: error: {error}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_MODEL_ERROR) from None
