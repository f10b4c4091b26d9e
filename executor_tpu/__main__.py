"""`python -m executor_tpu`: serve the Executor gRPC service on a TPU (or XLA:CPU)."""

from common.host.server import build_arg_parser, serve
from executor_tpu.options import add_tpu_arguments, options_from_args, select_pjrt_device


def main() -> None:
    parser = build_arg_parser(
        "python -m executor_tpu",
        "Tandem TPU executor: runs the model steps a controller sends on a TPU through "
        "torch_xla, every step padded to precompiled shapes (XLA:CPU without a TPU).",
    )
    add_tpu_arguments(parser)
    args = parser.parse_args()
    select_pjrt_device(args.device)  # before torch_xla starts its runtime
    options = options_from_args(args)

    from executor_tpu.worker import TPUWorker

    serve(lambda config: TPUWorker(config, options), args)


if __name__ == "__main__":
    main()
