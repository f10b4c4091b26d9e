"""The one error a model source raises for what users get wrong."""

from __future__ import annotations


class ModelSourceError(Exception):
    """A model that cannot be served as given: not found, not reachable, gated, or a
    checkpoint that lacks a file Tandem reads. Its message is one line that names what is
    missing and how to fix it; programs print it and exit non-zero, without a traceback."""
