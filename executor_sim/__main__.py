"""`python -m executor_sim`: serve the Executor gRPC service with a simulated device."""

from __future__ import annotations

import logging
import os

from common.host.server import (
    configure_logging,
    mark_serving,
    prepare_model,
    serve,
    shut_down,
    start_metrics_server,
    start_server,
    wait_for_signal,
)
from common.hub.files import Need
from executor_sim.options import SimSettings
from executor_sim.worker import SimWorker

DESCRIPTION = (
    "Tandem simulated executor: the Executor gRPC service with no model; steps sleep for a "
    "modeled time and sample random tokens."
)


def serve_many(settings: SimSettings) -> None:
    """``--count`` simulated executors in one process (for fleet-scale tests and benchmarks:
    hundreds of executors on one machine). Each has its own worker, seed and gRPC server; the
    Prometheus counters are the process's, summed over them."""
    configure_logging(settings)
    if settings.metrics_port:
        start_metrics_server(settings.host, settings.metrics_port)
    servers = []
    for i in range(settings.count):
        config = settings.model_copy(update={"seed": settings.seed + i})
        worker = SimWorker(config, settings)
        port = settings.port + i if settings.port else 0
        step_port = settings.step_port + i if settings.step_port else 0
        servers.append(start_server(worker, settings, port, step_port))
    for served in servers:
        served.servicer.load()
        mark_serving(served)
    if settings.ports_file:
        with open(settings.ports_file + ".tmp", "w") as f:
            f.writelines(f"{s.port}\n" for s in servers)
        os.replace(settings.ports_file + ".tmp", settings.ports_file)  # readers see all or none
    logging.getLogger(__name__).info("ready: %d simulated executors", len(servers))
    wait_for_signal()
    shut_down(servers, settings.shutdown_drain)


def main(argv: list[str] | None = None, prog: str = "python -m executor_sim") -> None:
    """Load the settings, then serve one simulated executor or ``--count`` of them."""
    settings = SimSettings.load(argv, prog=prog, description=DESCRIPTION)
    settings = prepare_model(settings, prog, Need.CONFIG)  # it reads config.json alone
    if settings.serves_many:
        serve_many(settings)
    else:
        serve(lambda config: SimWorker(config, settings), settings)


if __name__ == "__main__":
    main()
