"""`python -m executor_sim`: serve the Executor gRPC service with a simulated device."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os

from common.host.server import (
    build_arg_parser,
    check_security_args,
    config_from_args,
    configure_logging,
    mark_serving,
    serve,
    shut_down,
    start_metrics_server,
    start_server,
    wait_for_signal,
)
from executor_sim.latency import LatencyModel
from executor_sim.worker import SimOptions, SimWorker


def build_parser() -> argparse.ArgumentParser:
    """The executor flags plus the simulation's own."""
    p = build_arg_parser(
        "python -m executor_sim",
        "Tandem simulated executor: the Executor gRPC service with no model; steps sleep "
        "for a modeled time and sample random tokens.",
    )
    sim = p.add_argument_group("simulation")
    sim.add_argument(
        "--step-fixed-ms", type=float, default=5.0, help="milliseconds every step costs"
    )
    sim.add_argument(
        "--step-per-token-us", type=float, default=20.0, help="microseconds per scheduled token"
    )
    sim.add_argument(
        "--step-per-request-us", type=float, default=0.0, help="microseconds per scheduled request"
    )
    sim.add_argument(
        "--step-per-context-token-ns",
        type=float,
        default=0.0,
        help="nanoseconds per token attended to (sum of sequence lengths)",
    )
    sim.add_argument(
        "--step-jitter",
        type=float,
        default=0.0,
        help="relative uniform noise on each step's time (0.1 = +-10%%)",
    )
    sim.add_argument(
        "--num-blocks",
        type=int,
        default=0,
        help="KV blocks to report (0: --kv-cache-bytes, else 4096 blocks)",
    )
    sim.add_argument(
        "--eos-prob",
        type=float,
        default=0.0,
        help="chance per token of sampling EOS / a stop id (after min_tokens)",
    )
    sim.add_argument(
        "--sample-vocab-size",
        type=int,
        default=0,
        help="sample ids below this (0 = the whole vocabulary)",
    )
    sim.add_argument("--device-kind", default="gpu", help="device kind reported")
    sim.add_argument("--device-name", default="simulated", help="device name reported")
    sim.add_argument(
        "--count",
        type=int,
        default=1,
        help="simulated executors in this process, each its own gRPC server on "
        "ports --port, --port + 1, ... (any free ports with --port 0)",
    )
    sim.add_argument(
        "--ports-file",
        default="",
        help="once every executor serves, write their ports here, one per line",
    )
    return p


def options_from_args(args: argparse.Namespace) -> SimOptions:
    """The SimOptions the flags describe."""
    return SimOptions(
        latency=LatencyModel(
            fixed_s=args.step_fixed_ms / 1e3,
            per_token_s=args.step_per_token_us / 1e6,
            per_request_s=args.step_per_request_us / 1e6,
            per_context_token_s=args.step_per_context_token_ns / 1e9,
            jitter=args.step_jitter,
        ),
        num_blocks=args.num_blocks,
        eos_prob=args.eos_prob,
        sample_vocab_size=args.sample_vocab_size,
        device_kind=args.device_kind,
        device_name=args.device_name,
    )


def serve_many(args: argparse.Namespace, options: SimOptions) -> None:
    """``--count`` simulated executors in one process (for fleet-scale tests and benchmarks:
    hundreds of executors on one machine). Each has its own worker, seed and gRPC server; the
    Prometheus counters are the process's, summed over them."""
    configure_logging(args)
    check_security_args(args)
    if args.health_port:
        raise SystemExit("--health-port serves one executor: not with --count")
    if args.metrics_port:
        start_metrics_server(args.host, args.metrics_port)
    config = config_from_args(args)
    servers = []
    for i in range(args.count):
        worker = SimWorker(dataclasses.replace(config, seed=config.seed + i), options)
        servers.append(start_server(worker, args, args.port + i if args.port else 0))
    for served in servers:
        served.servicer.load()
        mark_serving(served)
    if args.ports_file:
        with open(args.ports_file + ".tmp", "w") as f:
            f.writelines(f"{s.port}\n" for s in servers)
        os.replace(args.ports_file + ".tmp", args.ports_file)  # readers see all or nothing
    logging.getLogger(__name__).info("ready: %d simulated executors", len(servers))
    wait_for_signal()
    shut_down(servers, args.shutdown_drain)


def main() -> None:
    args = build_parser().parse_args()
    options = options_from_args(args)
    if args.count > 1 or args.ports_file:
        serve_many(args, options)
    else:
        serve(lambda config: SimWorker(config, options), args)


if __name__ == "__main__":
    main()
