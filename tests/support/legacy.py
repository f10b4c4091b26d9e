"""What the programs' command lines were before their settings were declared once: each
program's --help and a table of its flags (dest, default, action, choices), saved from the
argparse parsers they replaced, in tests/support/legacy_help/."""

from __future__ import annotations

import json
import os
import re

FOLDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "legacy_help")


def legacy_flags(program: str) -> dict[str, dict]:
    """Flag -> {dest, default, action, choices, required} of `python -m <program>` before."""
    with open(os.path.join(FOLDER, "flags.json")) as f:
        return json.load(f)[program]


def legacy_help_flags(program: str) -> set[str]:
    """Every --flag the old --help of `python -m <program>` named."""
    with open(os.path.join(FOLDER, f"{program}.txt")) as f:
        return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", f.read())) - {"--help"}
