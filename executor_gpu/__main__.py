"""`python -m executor_gpu`: serve the Executor gRPC service on a CUDA device (or the CPU)."""

import os

# CPU steps run OpenMP parallel regions back to back; threads that spin between them stall
# whenever another process (a controller, a load generator) takes a core for a moment, which
# made colocated serving ~1.5x slower here. Waiting passively costs ~8% alone and wins
# overall; bounded spinning does not help either: bf16 decode steps on 2 threads of a loaded
# 2-core machine took 22 / 72 / 85 ms (batch 1 / 16 / 64) passive, 379 / 606 / 493 ms with
# OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=10000 and 1546 / 3007 / 2125 ms with libgomp's default
# (benchmarks/README.md, 2026-12-02). On an EPYC host passive waiting costs more (alone, a step
# takes 0.6x the time with GOMP_SPINCOUNT=1000), yet served with a controller and clients on the
# same 2 cores that spin was 0.90-0.93x as fast (benchmarks/README.md, 2026-12-03): passive
# stays. Set before torch loads OpenMP; an explicit setting is kept. (No effect on CUDA.)
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
