"""`python -m executor_gpu`: serve the Executor gRPC service on a CUDA device (or the CPU)."""

import os

# CPU steps run OpenMP parallel regions back to back. Threads that spin between them convoy when
# more of them than cores share the machine (two executors on 2 cores: steps ~10x slower), so
# they wait passively unless told otherwise. OMP_WAIT_POLICY set but empty asks for libgomp's
# default (spin a few ms, then sleep), faster for an executor with its cores to itself (see
# README, executor_gpu). Set before torch loads OpenMP; an explicit setting is kept.
if os.environ.get("OMP_WAIT_POLICY") == "":
    del os.environ["OMP_WAIT_POLICY"]
else:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from common.executor_server import build_arg_parser, serve  # noqa: E402
from executor_gpu.worker import GPUWorker  # noqa: E402


def main() -> None:
    parser = build_arg_parser(
        "python -m executor_gpu",
        "Tandem GPU executor: runs the model steps a controller sends (CUDA, else CPU).",
    )
    serve(GPUWorker, parser.parse_args())


if __name__ == "__main__":
    main()
