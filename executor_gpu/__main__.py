"""`python -m executor_gpu`: serve the Executor gRPC service on a CUDA device (or the CPU)."""

import os

# The CPU kernels' linear layers and attention run on a task pool of their own
# (executor_gpu/cpu/task_pool.cpp) whose caller never waits for a sleeping helper; OpenMP still
# runs torch's operators and the layer ops at prefill sizes. Threads that spin between OpenMP
# regions stall whenever another process (a controller, a load generator) takes a core for a
# moment, which made colocated serving ~1.5x slower on the 2-core development machine; on an
# EPYC host a short spin (GOMP_SPINCOUNT=1000) served 0.90-0.93x as fast (benchmarks/README.md,
# 2026-12-03): passive stays. Set before torch loads OpenMP; an explicit setting is kept. (No
# effect on CUDA.)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from common.host.server import prepare_model, serve  # noqa: E402
from common.host.settings import ExecutorSettings  # noqa: E402

DESCRIPTION = "Tandem GPU executor: runs the model steps a controller sends (CUDA, else CPU)."


def main(argv: list[str] | None = None, prog: str = "python -m executor_gpu") -> None:
    """Load the settings, then serve a GPU worker until SIGTERM/SIGINT."""
    settings = ExecutorSettings.load(argv, prog=prog, description=DESCRIPTION)
    settings = prepare_model(settings, prog)  # the model's files, before torch loads
    from executor_gpu.worker import GPUWorker  # torch: after the settings are known good

    serve(GPUWorker, settings)


if __name__ == "__main__":
    main()
