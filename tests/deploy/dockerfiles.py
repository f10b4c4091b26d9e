"""A small Dockerfile parser for the image tests (no Docker engine runs their checks): stages
with their instructions, RUN commands split, the pip requirements and apt packages a stage
installs, and each image's .dockerignore."""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from pathlib import Path

DOCKER = Path(__file__).resolve().parents[2] / "docker"


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, rest)

    def all(self, instruction: str) -> list[str]:
        return [rest for ins, rest in self.instructions if ins == instruction]


def parse_dockerfile(text: str) -> list[Stage]:
    """Stages of a Dockerfile: comments dropped, continuation lines joined, FROM splits stages."""
    logical, current = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and current):
            continue  # comments (and the syntax directive); blank lines inside a continuation
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        if current.strip():
            logical.append(current.strip())
        current = ""
    assert not current, "Dockerfile ends inside a line continuation"
    stages: list[Stage] = []
    global_args: dict[str, str] = {}  # ARGs before the first FROM: what FROM lines may use
    for line in logical:
        instruction, _, rest = line.partition(" ")
        instruction, rest = instruction.upper(), rest.strip()
        if instruction == "ARG" and not stages:
            name, _, default = rest.partition("=")
            global_args[name] = default
        elif instruction == "FROM":
            m = re.fullmatch(r"(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", rest, re.I)
            assert m, f"unparsable FROM {rest!r}"
            base = re.sub(r"\$\{(\w+)\}", lambda a: global_args[a.group(1)], m.group(1))
            stages.append(Stage(base=base, name=m.group(2)))
        else:
            assert stages, f"{instruction} before the first FROM"
            stages[-1].instructions.append((instruction, rest))
    return stages


def dockerfile(image: str) -> list[Stage]:
    return parse_dockerfile((DOCKER / f"{image}.Dockerfile").read_text())


def commands(run: str) -> list[str]:
    """The shell commands of a RUN instruction (its --mount options left out)."""
    return re.split(r"&&|;|\|\|", re.sub(r"^(--mount=\S+\s+)+", "", run))


def pip_requirements(stages: list[Stage]) -> list[str]:
    """Every requirement given to `pip install` in RUN instructions (options left out)."""
    reqs = []
    for stage in stages:
        for run in stage.all("RUN"):
            for command in commands(run):
                words = command.split()
                if words[:2] == ["pip", "install"] or words[1:4] == ["-m", "pip", "install"]:
                    start = words.index("install") + 1
                    reqs += [w.strip("\"'") for w in words[start:] if not w.startswith(("-", "$"))]
    return reqs


def apt_installs(stage: Stage) -> list[tuple[str, list[str]]]:
    """(the RUN, the packages) of every `apt-get install` in a stage's RUN instructions."""
    found = []
    for run in stage.all("RUN"):
        for command in commands(run):
            words = command.split()
            if words[:2] == ["apt-get", "install"]:
                found.append((run, [w for w in words[2:] if not w.startswith("-")]))
    return found


def dockerignore_admits(patterns: list[str], path: str) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    parts = path.split("/")
    admitted = True
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern[1:] if negate else pattern
        pat = pat.rstrip("/")
        for i in range(1, len(parts) + 1):
            prefix = "/".join(parts[:i])
            if (
                fnmatch.fnmatchcase(prefix, pat)
                or (pat.startswith("**/") and fnmatch.fnmatchcase(prefix, pat[3:]))
                or (pat.startswith("**/") and fnmatch.fnmatchcase(prefix, "*/" + pat[3:]))
            ):
                admitted = negate
                break
    return admitted


def dockerignore(image: str) -> list[str]:
    path = DOCKER / f"{image}.Dockerfile.dockerignore"
    return [
        ln.strip()
        for ln in path.read_text().splitlines()
        if ln.strip() and not ln.strip().startswith("#")
    ]
