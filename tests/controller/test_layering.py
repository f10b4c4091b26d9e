"""The controller's layers import only what they may (DESIGN.md, "Boundaries"): core is pure
Python that knows nothing of the rest of the controller, and observe reads the fleet through
snapshots and callables, never by importing it. Each check imports the layer in a fresh
interpreter and looks at what got loaded."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _loaded_after_importing(package: str) -> set[str]:
    """Module names loaded by importing every module of `package` (a fresh interpreter)."""
    code = (
        "import importlib, pkgutil, sys\n"
        f"pkg = importlib.import_module({package!r})\n"
        "for m in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + '.'):\n"
        "    importlib.import_module(m.name)\n"
        "print('\\n'.join(sorted(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return set(out.stdout.split())


def _named_imports(folder: str) -> set[str]:
    """Every module named by an import statement in a folder's files, TYPE_CHECKING included
    (absolute imports: the tree uses no relative ones)."""
    names = set()
    for name in os.listdir(os.path.join(ROOT, folder)):
        if name.endswith(".py"):
            with open(os.path.join(ROOT, folder, name)) as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names |= {a.name for a in node.names}
                elif isinstance(node, ast.ImportFrom):
                    assert node.level == 0, f"{name}: relative import"
                    names.add(node.module or "")
    return names


def _roots(modules: set[str]) -> set[str]:
    return {m.split(".")[0] for m in modules}


def test_core_imports_no_runtime_framework_and_nothing_of_the_controller_outside_core():
    banned = {"asyncio", "grpc", "fastapi", "starlette", "uvicorn", "torch"}
    for modules in (_loaded_after_importing("controller.core"), _named_imports("controller/core")):
        assert not _roots(modules) & banned
        outside = {
            m
            for m in modules
            if m.startswith("controller.") and not m.startswith("controller.core")
        }
        assert not outside


def test_observe_imports_nothing_of_the_fleet_or_the_api():
    loaded = _loaded_after_importing("controller.observe")
    assert not {m for m in loaded if m.startswith(("controller.fleet", "controller.api"))}
