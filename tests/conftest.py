"""Fixtures every test folder may use: the default model and the transformers reference.

Process helpers live in tests/support/; live-server fixtures next to their users
(tests/e2e/conftest.py).
"""

from __future__ import annotations

import os

import pytest

from tests.support.hf_reference import HFReference
from tests.support.processes import model_dir

# Triton kernels run under Triton's interpreter on CPU tensors in this process (the flag must be
# set before triton is first imported; tests/executor_gpu/cuda/test_triton_kernels.py relies on
# it).
os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    path = model_dir()
    if not os.path.exists(os.path.join(path, "config.json")):
        pytest.skip(f"default model missing at {path} (run `make model`)")
    return path


@pytest.fixture(scope="session")
def hf(default_model_dir) -> HFReference:
    return HFReference(default_model_dir)
