"""`tandem COMMAND [ARGS]`: every Tandem program behind one command.

Each command hands its arguments to the program's own settings, so `tandem controller ...`
takes exactly what `python -m controller ...` takes; this module only picks the program.
"""

from __future__ import annotations

import importlib
import sys

USAGE = """usage: tandem COMMAND [ARGS]

commands:
  serve [FLAGS]                   serve a model locally: the controller and its executor(s) as
                                  child processes (see `tandem serve --help`)
  controller [FLAGS]              the controller (python -m controller)
  executor gpu|tpu|sim [FLAGS]    an executor (python -m executor_gpu, _tpu, _sim)
  bench [NAME [ARGS]]             run benchmarks/NAME.py of this checkout; alone: list them

Every program's --help lists its flags with their defaults and TANDEM_* variables.
"""

EXECUTOR_KINDS = ("gpu", "tpu", "sim")  # tandem executor KIND -> module executor_KIND


def _usage_error(message: str) -> int:
    print(USAGE + f"\ntandem: error: {message}", file=sys.stderr)
    return 2


def _executor(argv: list[str]) -> int:
    if not argv or argv[0] not in EXECUTOR_KINDS:
        got = repr(argv[0]) if argv else "nothing"
        return _usage_error(f"tandem executor takes {', '.join(EXECUTOR_KINDS)}; got {got}")
    kind = argv[0]
    # The module's import sets what must precede torch (executor_gpu: OMP_WAIT_POLICY).
    program = importlib.import_module(f"executor_{kind}.__main__")
    program.main(argv[1:], prog=f"tandem executor {kind}")
    return 0


def _controller(argv: list[str]) -> int:
    from controller.main import main as controller_main

    controller_main(argv, prog="tandem controller")
    return 0


def _serve(argv: list[str]) -> int:
    from tandem.serve import main as serve_main

    return serve_main(argv)


def _bench(argv: list[str]) -> int:
    from tandem.bench import main as bench_main

    return bench_main(argv)


COMMANDS = {"serve": _serve, "controller": _controller, "executor": _executor, "bench": _bench}


def main(argv: list[str] | None = None) -> int:
    """Run the command ``argv`` names (default: sys.argv[1:]); its exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        print(USAGE, end="", file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0
    command = COMMANDS.get(argv[0])
    if command is None:
        return _usage_error(f"unknown command {argv[0]!r}")
    return command(argv[1:])
