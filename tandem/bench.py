"""`tandem bench [NAME [ARGS]]`: the benchmarks of a source checkout (benchmarks/NAME.py),
run as they are with the arguments given; `tandem bench` alone lists them."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

#: The checkout this package was imported from (an installed wheel has no benchmarks/).
CHECKOUT = Path(__file__).resolve().parent.parent


def benchmarks_dir(root: Path = CHECKOUT) -> Path | None:
    """The checkout's benchmarks folder, or None outside a checkout."""
    folder = root / "benchmarks"
    return folder if folder.is_dir() and (root / "pyproject.toml").is_file() else None


def summary(path: Path) -> str:
    """The first line of a benchmark's docstring."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def available(folder: Path) -> dict[str, Path]:
    """Benchmark name -> script."""
    return {p.stem: p for p in sorted(folder.glob("*.py")) if not p.stem.startswith("_")}


def listing(folder: Path) -> str:
    """One line per benchmark: its name and what it measures."""
    scripts = available(folder)
    width = max(map(len, scripts), default=0)
    lines = [f"  {name:<{width}}  {summary(path)}" for name, path in scripts.items()]
    return "usage: tandem bench NAME [ARGS]   (NAME --help: its flags)\n\nbenchmarks:\n" + (
        "\n".join(lines) + "\n"
    )


def main(argv: list[str], root: Path = CHECKOUT) -> int:
    """List the benchmarks, or run one with ``argv[1:]``; its exit status."""
    folder = benchmarks_dir(root)
    if folder is None:
        print(
            f"tandem bench: no benchmarks/ next to {root / 'tandem'}: the benchmarks come "
            "with a source checkout of Tandem (git clone), not with an installed package",
            file=sys.stderr,
        )
        return 2
    if not argv or argv[0] in ("-h", "--help"):
        print(listing(folder), end="")
        return 0
    script = available(folder).get(argv[0])
    if script is None:
        print(listing(folder) + f"\ntandem bench: no benchmark {argv[0]!r}", file=sys.stderr)
        return 2
    child = subprocess.Popen([sys.executable, str(script), *argv[1:]])
    try:
        return child.wait()
    except KeyboardInterrupt:  # Ctrl-C reached the benchmark too: let it finish its way
        return child.wait()
