"""`python -m executor_gpu`: serve the Executor gRPC service on a CUDA device (or the CPU)."""

import os

# CPU steps run OpenMP parallel regions back to back; threads that spin between them stall
# whenever another process (a controller, a load generator) takes a core for a moment, which
# made colocated serving ~1.5x slower here. Waiting passively costs ~8% alone and wins
# overall. Set before torch loads OpenMP; an explicit setting is kept. (No effect on CUDA.)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from common.host.server import build_arg_parser, serve  # noqa: E402
from executor_gpu.worker import GPUWorker  # noqa: E402


def main() -> None:
    parser = build_arg_parser(
        "python -m executor_gpu",
        "Tandem GPU executor: runs the model steps a controller sends (CUDA, else CPU).",
    )
    serve(GPUWorker, parser.parse_args())


if __name__ == "__main__":
    main()
