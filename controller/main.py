"""The controller's composition root: settings in, every part built and wired, served until
SIGTERM. `python -m controller` and `tandem controller` both run `main`."""

from __future__ import annotations

import gc

from common.hub.files import CONTROLLER
from common.hub.resolve import resolve_or_exit
from common.logs import configure_logging
from controller.api.admission import Admission, AdmissionLimits
from controller.api.forwarding import Forwarder
from controller.api.http_guard import HTTPStats
from controller.api.http_server import HTTPCollector, uvicorn_config
from controller.api.server import create_app
from controller.api.serving import OpenAIServing
from controller.api.shutdown import GracefulServer
from controller.api.writers.pool import WriterPool
from controller.fleet.engine import Engine
from controller.settings import ControllerConfig
from controller.text.tokenizer import Tokenizer

DESCRIPTION = "Tandem controller: OpenAI API, scheduling and KV allocation for executors."


def load_config(argv: list[str] | None = None, prog: str = "python -m controller"):
    """The controller's settings from flags, TANDEM_* variables and --config (exit 2 if bad)."""
    return ControllerConfig.load(argv, prog=prog, description=DESCRIPTION)


def tune_gc() -> None:
    """Keep Python's cycle collector off the step loop's back: the objects of startup (the
    tokenizer, the app) are frozen out of its scans, and young-generation passes run every
    50,000 allocations instead of 700. A step allocates a handful of objects per request, so
    at 256 requests the default thresholds ran a collection several times per step and a
    full one every few hundred steps, each scanning every live request's state."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)


def build_server(config: ControllerConfig, model_dir: str = "") -> GracefulServer:
    """The tokenizer (from ``model_dir``, the model's local directory; default: --model),
    the engine over the fleet, admission, the OpenAI handlers and the app, behind a server
    that bounds its connections and drains on SIGTERM."""
    tokenizer = Tokenizer.from_model_dir(model_dir or config.model)
    engine = Engine(config, tokenizer)
    admission = Admission(
        AdmissionLimits(config.max_queued_requests, config.max_queued_tokens, config.retry_after)
    )
    forwarder = Forwarder(config, engine.peers, engine.metrics.registry)
    writers = None
    if config.stream_writers:
        writers = WriterPool(
            config.stream_writers,
            str(model_dir or config.model),
            config.stream_stall_timeout,
            engine.metrics.registry,
        )
    serving = OpenAIServing(
        engine,
        tokenizer,
        config.served_model_name,
        config.max_logprobs,
        admission,
        forwarder,
        writers,
    )
    http_stats = HTTPStats()
    engine.metrics.registry.register(HTTPCollector(http_stats))
    app = create_app(engine, serving, http_stats=http_stats)
    return GracefulServer(uvicorn_config(app, config, http_stats), admission, config.shutdown_grace)


def main(argv: list[str] | None = None, prog: str = "python -m controller") -> None:
    """Load the settings, build the controller and serve until SIGTERM/SIGINT."""
    config = load_config(argv, prog)
    configure_logging(config.log_level, config.log_format, service="controller")
    # A Hub id is fetched into its cached snapshot (config and tokenizer files only; --model
    # stays the id, as /v1/models reports it); a model that cannot be served ends the
    # program here, in one line.
    model = resolve_or_exit(config, CONTROLLER, prog)
    server = build_server(config, model.path)
    tune_gc()
    server.run()
