"""The pip requirements of an image: the project's dependencies and one extra's, from pyproject.

The executor images install these before the project itself (`pip install --no-deps .`), so
that torch, the largest layer, is its own layer built once per pin (and shared by the GPU and TPU
images: the same instruction after the same layers), and so that an image can take another
torch than the pin: `--torch "torch==2.13.0+cpu"` (a CPU build, for CPU nodes and the image
tests) replaces the pinned requirement and nothing else.

    python pyproject_requirements.py EXTRA [--torch REQUIREMENT]
    python pyproject_requirements.py --only-torch [--torch REQUIREMENT]

Prints one requirement a line; --only-torch: torch's alone, the pin every extra that names
torch shares. Runs with the build's Python alone (tomllib, no packages).
"""

from __future__ import annotations

import argparse
import re
import tomllib

_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def _name(requirement: str) -> str:
    """The normalized distribution name of a requirement (PEP 503)."""
    match = _NAME.match(requirement)
    if not match:
        raise ValueError(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def requirements(pyproject: dict, extra: str, torch: str = "") -> list[str]:
    """The project's dependencies and EXTRA's (its own `project[...]` extras expanded), in
    order, without repeats; torch's requirement replaced by `torch` when given."""
    project = pyproject["project"]
    own = _name(project["name"])
    extras = project.get("optional-dependencies", {})
    found: list[str] = []

    def add(reqs: list[str]) -> None:
        for req in reqs:
            if _name(req) == own:  # "tandem[controller,gpu]": that extra's requirements
                inner = re.search(r"\[([^\]]*)\]", req)
                for name in inner.group(1).split(",") if inner else []:
                    add(extras[name.strip()])
            elif req not in found:
                found.append(req)

    if extra not in extras:
        raise SystemExit(f"pyproject.toml has no extra {extra!r}")
    add(list(project.get("dependencies", [])) + extras[extra])
    if torch:
        found = [torch if _name(r) == "torch" else r for r in found]
    return found


def torch_pin(pyproject: dict, torch: str = "") -> str:
    """The torch requirement of every extra that names torch (they must agree: the images share
    its layer, and torch_xla needs exactly its torch), or `torch` when given."""
    extras = pyproject["project"].get("optional-dependencies", {})
    pins = {r for reqs in extras.values() for r in reqs if _name(r) == "torch"}
    if len(pins) != 1:
        raise SystemExit(f"the extras pin torch differently: {sorted(pins)}")
    return torch or pins.pop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("extra", nargs="?", help="the pyproject extra, e.g. gpu")
    parser.add_argument("--torch", default="", help="torch's requirement instead of the pin")
    parser.add_argument("--only-torch", action="store_true", help="print torch's line alone")
    parser.add_argument("--pyproject", default="pyproject.toml")
    args = parser.parse_args()
    if not args.extra and not args.only_torch:
        parser.error("an extra, or --only-torch")
    with open(args.pyproject, "rb") as f:
        pyproject = tomllib.load(f)
    if args.only_torch:
        print(torch_pin(pyproject, args.torch))
    else:
        print("\n".join(requirements(pyproject, args.extra, args.torch)))


if __name__ == "__main__":
    main()
