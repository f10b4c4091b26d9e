"""`python -m controller`: the OpenAI-compatible endpoint in front of executors."""

from __future__ import annotations

import argparse
import logging
import os

import uvicorn

from controller.api.server import create_app
from controller.api.serving import OpenAIServing
from controller.config import ControllerConfig
from controller.engine import Engine
from controller.tokenizer import Tokenizer


def parse_args(argv=None) -> ControllerConfig:
    p = argparse.ArgumentParser(
        prog="python -m controller",
        description="Tandem controller: OpenAI API, scheduling and KV allocation for executors.",
    )
    p.add_argument("--model", required=True, help="local Hugging Face model directory")
    p.add_argument("--served-model-name", default="", help="name clients use (default: dir name)")
    p.add_argument("--executor", action="append", default=[], dest="executors",
                   help="executor address host:port (repeatable)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget/step")
    p.add_argument("--max-num-seqs", type=int, default=128, help="most requests per step")
    p.add_argument("--max-model-len", type=int, default=0, help="0 = the model's own")
    p.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="cap one request's prefill chunk (0 = none)")
    p.add_argument("--num-kv-blocks", type=int, default=0,
                   help="override the profiled KV block count (0 = profiled)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--policy", choices=["fcfs", "priority"], default="fcfs")
    p.add_argument("--scheduler", default="", help="custom scheduler as module:Class")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-timeout", type=float, default=300.0)
    p.add_argument("--executor-startup-timeout", type=float, default=900.0)
    p.add_argument("--max-logprobs", type=int, default=20)
    p.add_argument("--log-level", default="INFO")
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return ControllerConfig(
        model=a.model,
        served_model_name=a.served_model_name or os.path.basename(os.path.normpath(a.model)),
        executors=a.executors or ["127.0.0.1:50051"],
        host=a.host,
        port=a.port,
        max_num_batched_tokens=a.max_num_batched_tokens,
        max_num_seqs=a.max_num_seqs,
        max_model_len=a.max_model_len,
        long_prefill_token_threshold=a.long_prefill_token_threshold,
        num_kv_blocks=a.num_kv_blocks,
        enable_prefix_caching=not a.no_prefix_caching,
        policy=a.policy,
        scheduler_class=a.scheduler,
        seed=a.seed,
        step_timeout=a.step_timeout,
        executor_startup_timeout=a.executor_startup_timeout,
        max_logprobs=a.max_logprobs,
    )


def main(argv=None) -> None:
    config = parse_args(argv)
    tokenizer = Tokenizer.from_model_dir(config.model)
    engine = Engine(config, tokenizer)
    serving = OpenAIServing(engine, tokenizer, config.served_model_name, config.max_logprobs)
    app = create_app(engine, serving)
    uvicorn.run(app, host=config.host, port=config.port, log_level="warning",
                timeout_graceful_shutdown=10)


if __name__ == "__main__":
    main()
