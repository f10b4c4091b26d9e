"""Fixtures shared by the CPU kernel tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def threads():
    """Set torch's thread count (the kernels' task pool size) for a test; restored after it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)
