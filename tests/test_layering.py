"""Who may import what (CONTRIBUTING.md, docs/architecture.md): the import-linter contracts of
.importlinter, checked on the source (imports under TYPE_CHECKING and inside functions count),
and what importing each torch-free layer really loads in a fresh interpreter (which also catches
imports by name through importlib)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.processes import ROOT


def test_import_contracts_hold():
    """Layers, forbidden imports, independent executors and no import circle at any depth."""
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from importlinter.cli import lint_imports; "
            "sys.exit(lint_imports(no_logo=True))",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert "0 broken" in run.stdout


def test_a_broken_contract_is_reported(tmp_path):
    """The contracts bite: with the fleet put above the API, the API's use of the engine is
    reported."""
    with open(f"{ROOT}/.importlinter") as f:
        config = f.read()
    reversed_layers = config.replace("    api\n    fleet\n", "    fleet\n    api\n", 1)
    assert reversed_layers != config
    path = tmp_path / "reversed.ini"
    path.write_text(reversed_layers)
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from importlinter.cli import lint_imports; "
            f"sys.exit(lint_imports(config_filename={str(path)!r}, no_logo=True))",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode != 0
    assert "controller.api is not allowed to import controller.fleet" in run.stdout


def _loaded_after_importing(package: str) -> set[str]:
    """Module names loaded by importing every module of ``package``, recursively, in a fresh
    interpreter (``__main__`` modules excepted: they run a program)."""
    code = (
        "import importlib, pkgutil, sys\n"
        f"pkg = importlib.import_module({package!r})\n"
        "for m in pkgutil.walk_packages(getattr(pkg, '__path__', []), pkg.__name__ + '.'):\n"
        "    if not m.name.endswith('__main__'):\n"
        "        importlib.import_module(m.name)\n"
        "print('\\n'.join(sorted(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return set(out.stdout.split())


def _roots(modules: set[str]) -> set[str]:
    return {m.split(".")[0] for m in modules}


@pytest.mark.parametrize(
    "package, banned",
    [
        # The controller image carries no torch.
        ("controller", {"torch", "torch_xla", "triton", "executor_gpu", "executor_tpu"}),
        # The core is driven step by step, without an event loop, RPC or HTTP.
        ("controller.core", {"asyncio", "grpc", "fastapi", "starlette", "uvicorn", "torch"}),
        ("common.wire", {"torch", "controller"}),
        ("common.settings", {"torch", "controller"}),
        ("common.host", {"torch", "controller"}),
        # Model sources: the controller resolves its model there too.
        ("common.hub", {"torch", "controller"}),
        # The simulator serves hundreds of executors per machine without torch.
        ("executor_sim", {"torch", "controller"}),
    ],
)
def test_torch_free_layers_load_nothing_forbidden(package, banned):
    assert not _roots(_loaded_after_importing(package)) & banned


def test_core_and_observe_load_no_outer_controller_layer():
    """The core knows nothing of the controller outside it; observe reads the fleet through
    snapshots and callables, never by importing it."""
    core = _loaded_after_importing("controller.core")
    assert not {
        m for m in core if m.startswith("controller.") and not m.startswith(("controller.core",))
    }
    observe = _loaded_after_importing("controller.observe")
    assert not {m for m in observe if m.startswith(("controller.fleet", "controller.api"))}
