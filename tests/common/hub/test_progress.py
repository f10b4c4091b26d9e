"""Progress while downloading and loading: log lines, not bars, when stderr is no terminal."""

from __future__ import annotations

import logging

from common.hub import progress


def test_log_lines_at_most_every_interval_and_at_the_end(monkeypatch, caplog):
    clock = [1000.0]
    monkeypatch.setattr(progress, "PROGRESS_SECONDS", 10.0)
    monkeypatch.setattr("tqdm.std.time", lambda: clock[0])  # tqdm's clock
    caplog.set_level(logging.INFO, logger="common.hub.progress")
    bar = progress.LogProgress(total=300 << 20, desc="Downloading bytes", unit="B", unit_scale=True)
    for _ in range(30):  # 30 updates over 15 s: two intervals pass
        clock[0] += 0.5
        bar.update(10 << 20)
    bar.close()
    lines = [r.getMessage() for r in caplog.records]
    assert 2 <= len(lines) <= 4, lines
    assert lines[-1] == "Downloading bytes: 300.0 MiB of 300.0 MiB"
    assert all(line.startswith("Downloading bytes: ") and " of 300.0 MiB" in line for line in lines)
    assert progress.format_bytes(1000) == "1000 B" and progress.format_bytes(3 << 30) == "3.0 GiB"


def test_counts_without_units(caplog):
    caplog.set_level(logging.INFO, logger="common.hub.progress")
    with progress.LogProgress(total=3, desc="Fetching 3 files") as bar:
        bar.update(3)
    assert caplog.records[-1].getMessage() == "Fetching 3 files: 3 of 3"


def test_bars_on_a_terminal_lines_otherwise(monkeypatch):
    monkeypatch.setattr(progress, "on_terminal", lambda: False)
    assert progress.progress_class() is progress.LogProgress
    assert isinstance(progress.progress_bar(10, "x"), progress.LogProgress)
    monkeypatch.setattr(progress, "on_terminal", lambda: True)
    assert progress.progress_class() is None  # huggingface_hub's own bars
    assert not isinstance(progress.progress_bar(10, "x"), progress.LogProgress)
