"""`python -m executor_tpu`: serve the Executor gRPC service on a TPU (or XLA:CPU)."""

from common.host.server import prepare_model, serve
from executor_tpu.options import TPUSettings, select_pjrt_device

DESCRIPTION = (
    "Tandem TPU executor: runs the model steps a controller sends on a TPU through torch_xla, "
    "every step padded to precompiled shapes (XLA:CPU without a TPU)."
)


def main(argv: list[str] | None = None, prog: str = "python -m executor_tpu") -> None:
    """Load the settings, choose the PJRT device, then serve a TPU worker until SIGTERM."""
    settings = TPUSettings.load(argv, prog=prog, description=DESCRIPTION)
    settings = prepare_model(settings, prog)  # the model's files, before torch_xla loads
    select_pjrt_device(settings.device)  # before torch_xla starts its runtime

    from executor_tpu.worker import TPUWorker

    serve(lambda config: TPUWorker(config, settings), settings)


if __name__ == "__main__":
    main()
