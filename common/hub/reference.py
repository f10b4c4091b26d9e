"""What a `--model` reference names: a local directory, or a model id on the Hugging Face Hub."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from common.hub.errors import ModelSourceError

# ORG/NAME or NAME, as the Hub spells repository ids (letters, digits, '-', '_', '.').
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
# How a path starts when it cannot be a Hub id.
_PATH_PREFIXES = ("/", "./", "../", "~", ".")


@dataclass(frozen=True)
class ModelRef:
    """A parsed `--model` value."""

    text: str  # the value as given
    is_local: bool  # a path on this machine (else a Hub id)
    path: str  # the expanded path when local; "" for a Hub id


def parse_reference(text: str) -> ModelRef:
    """A local directory when one exists at ``text`` or it is written as a path (absolute,
    ./, ~); else a Hub id (ORG/NAME). Raises ModelSourceError for a value that is neither."""
    text = text.strip()
    if not text:
        raise ModelSourceError("--model is empty: give a model directory or a Hub id (ORG/NAME)")
    path = os.path.expanduser(text)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ModelSourceError(f"--model {text} is a file: give a checkpoint directory")
    if os.path.isdir(path) or text.startswith(_PATH_PREFIXES):
        return ModelRef(text, True, path)
    if _HUB_ID.fullmatch(text) and ".." not in text and not text.endswith("."):
        return ModelRef(text, False, "")
    raise ModelSourceError(f"--model {text} is neither a directory nor a Hub model id (ORG/NAME)")


def default_served_name(text: str) -> str:
    """The name clients use when none is given: the Hub id itself (as vLLM does), or the
    directory's name."""
    text = text.strip()
    path = os.path.expanduser(text)
    if os.path.isdir(path) or text.startswith(_PATH_PREFIXES) or not _HUB_ID.fullmatch(text):
        return os.path.basename(os.path.normpath(path))
    return text
