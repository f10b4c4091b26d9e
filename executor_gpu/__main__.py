"""`python -m executor_gpu`: serve the Executor gRPC service on a CUDA device (or the CPU)."""

from common.executor_server import build_arg_parser, serve
from executor_gpu.worker import GPUWorker


def main() -> None:
    parser = build_arg_parser(
        "python -m executor_gpu",
        "Tandem GPU executor: runs the model steps a controller sends (CUDA, else CPU).",
    )
    serve(GPUWorker, parser.parse_args())


if __name__ == "__main__":
    main()
