"""docker/pyproject_requirements.py: what the executor images install before the project."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "docker" / "pyproject_requirements.py"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]


def _printed(*args: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--pyproject", str(ROOT / "pyproject.toml")],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.split()


@pytest.mark.parametrize("extra", ["gpu", "tpu"])
def test_prints_the_dependencies_and_the_extra(extra):
    expected = PROJECT["dependencies"] + PROJECT["optional-dependencies"][extra]
    assert _printed(extra) == list(dict.fromkeys(expected))
    assert _printed("--only-torch") == ["torch==2.9.0"]
    assert _printed("--only-torch", "--torch", "torch==2.13.0+cpu") == ["torch==2.13.0+cpu"]


def test_another_torch_replaces_the_pin_and_nothing_else():
    pinned, cpu = _printed("gpu"), _printed("gpu", "--torch", "torch==2.13.0+cpu")
    assert [r for r in cpu if r not in pinned] == ["torch==2.13.0+cpu"]
    assert [r for r in pinned if r not in cpu] == ["torch==2.9.0"]
    assert cpu.index("torch==2.13.0+cpu") == pinned.index("torch==2.9.0")


def test_every_extra_pins_the_same_torch():
    """The GPU and TPU images share torch's layer: one pin for every extra that names torch."""
    pins = {r for reqs in PROJECT["optional-dependencies"].values() for r in reqs}
    assert {r for r in pins if r.startswith("torch") and not r.startswith("torch_")} == {
        "torch==2.9.0"
    }


def test_the_projects_own_extras_are_expanded():
    dev = _printed("dev")
    assert not [r for r in dev if r.startswith("tandem")]
    for extra in ("controller", "gpu"):
        assert set(PROJECT["optional-dependencies"][extra]) <= set(dev)


def test_an_unknown_extra_fails():
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "nope", "--pyproject", str(ROOT / "pyproject.toml")],
        capture_output=True,
        text=True,
    )
    assert out.returncode != 0 and "no extra 'nope'" in out.stderr
