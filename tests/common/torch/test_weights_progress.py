"""Loading a checkpoint shows its progress: bytes read of the files' total (log lines when
stderr is not a terminal)."""

from __future__ import annotations

import logging
import os

import torch
from safetensors.torch import save_file

from common.hub import progress
from common.torch.models.weights import iterate_checkpoint


def test_loading_logs_bytes_read_of_the_total(tmp_path, monkeypatch, caplog):
    save_file({"a": torch.zeros(1000), "b": torch.ones(20, 30)}, str(tmp_path / "1.safetensors"))
    save_file({"c": torch.zeros(500)}, str(tmp_path / "2.safetensors"))
    total = sum(os.path.getsize(tmp_path / f"{i}.safetensors") for i in (1, 2))
    monkeypatch.setattr(progress, "on_terminal", lambda: False)
    caplog.set_level(logging.INFO, logger="common.hub.progress")
    names = [name for name, _ in iterate_checkpoint(str(tmp_path))]
    assert sorted(names) == ["a", "b", "c"]
    size = progress.format_bytes(total)
    assert caplog.records[-1].getMessage() == f"Loading weights: {size} of {size}"
