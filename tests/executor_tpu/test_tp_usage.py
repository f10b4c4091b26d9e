"""What a sharded TPU executor refuses before loading anything (no XLA runtime started)."""

from __future__ import annotations

import os

import pytest

from executor_tpu.__main__ import check_parallel
from executor_tpu.options import TPUSettings
from executor_tpu.spmd import prepare_devices


def test_xla_cpu_gets_virtual_devices(monkeypatch):
    # Set (empty) through monkeypatch, so that what the executor writes is undone afterwards.
    monkeypatch.setenv("CPU_NUM_DEVICES", "")
    prepare_devices(1, "CPU")
    assert os.environ["CPU_NUM_DEVICES"] == ""  # one device: today's path, untouched
    prepare_devices(4, "CPU")
    assert os.environ["CPU_NUM_DEVICES"] == "4"
    prepare_devices(4, "CPU")  # again: the same count is fine
    with pytest.raises(ValueError, match="CPU_NUM_DEVICES=2"):
        prepare_devices(2, "CPU")


def test_tpu_size_must_match_the_visible_chips(monkeypatch):
    monkeypatch.setenv("TPU_VISIBLE_CHIPS", "0,1,2,3")
    prepare_devices(4, "TPU")
    with pytest.raises(ValueError, match="sees 4 TPU chips"):
        prepare_devices(2, "TPU")
    prepare_devices(1, "TPU")  # unsharded: one chip, as before


def test_usage_errors_exit_before_loading(monkeypatch):
    monkeypatch.setenv("CPU_NUM_DEVICES", "3")
    with pytest.raises(ValueError, match="CPU_NUM_DEVICES=2"):
        check_parallel(TPUSettings.load(["--model", "m", "--tp", "2"]), "CPU")
    check_parallel(TPUSettings.load(["--model", "m", "--tp", "3", "--attention", "ragged"]), "CPU")
