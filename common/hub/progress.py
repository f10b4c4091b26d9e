"""Progress of long downloads and loads: tqdm's bar on a terminal, else a log line per bar
every PROGRESS_SECONDS (what a container's log shows)."""

from __future__ import annotations

import logging
import sys
from typing import Any

from tqdm.auto import tqdm

log = logging.getLogger("common.hub.progress")

PROGRESS_SECONDS = 10.0  # between two log lines of one bar


class _Discard:
    """A stream that drops what tqdm would draw."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


class LogProgress(tqdm):
    """A tqdm bar that logs "DESC: N of TOTAL" at most every PROGRESS_SECONDS, and once when
    it closes, instead of drawing itself."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("name", None)  # huggingface_hub's own bars take a group name
        kwargs.update(file=_Discard(), disable=False, mininterval=PROGRESS_SECONDS, miniters=1)
        kwargs.pop("dynamic_ncols", None)
        super().__init__(*args, **kwargs)

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        """Called by tqdm at most every mininterval, and on close: one log line."""
        if self.n or self.total:
            log.info("%s: %s of %s", self.desc or "progress", self._size(self.n), self._total())
        return True

    def _total(self) -> str:
        return self._size(self.total) if self.total else "?"

    def _size(self, n: float) -> str:
        if self.unit == "B":
            return format_bytes(n)
        return f"{int(n)}{'' if self.unit == 'it' else ' ' + self.unit}"


def format_bytes(n: float) -> str:
    """1536 -> "1.5 KiB"."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def on_terminal() -> bool:
    """Whether stderr is a terminal (bars) or a log (lines)."""
    return sys.stderr.isatty()


def progress_class() -> type[tqdm] | None:
    """The tqdm class huggingface_hub should draw with: its own on a terminal (None), else
    LogProgress."""
    return None if on_terminal() else LogProgress


def progress_bar(total: int, desc: str, unit: str = "B") -> tqdm:
    """A progress bar of ``total`` units: drawn on a terminal, logged otherwise."""
    cls = tqdm if on_terminal() else LogProgress
    return cls(total=total, desc=desc, unit=unit, unit_scale=True, unit_divisor=1024)
