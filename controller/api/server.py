"""The FastAPI application: middleware, error mapping, routes, lifecycle."""

from __future__ import annotations

import contextlib

from fastapi import FastAPI

from controller.api.auth import DEFAULT_EXEMPT_PATHS, AdminAuth, APIKeyAuth
from controller.api.body_timeout import BodyReadTimeout
from controller.api.error_handlers import install_error_handlers
from controller.api.http_guard import HTTPStats
from controller.api.limits import BodySizeLimit
from controller.api.request_ids import RequestIdMiddleware
from controller.api.routes_openai import add_openai_routes
from controller.api.routes_ops import VERSION, add_ops_routes
from controller.api.routes_tokens import add_tokens_routes
from controller.api.serving import OpenAIServing
from controller.fleet.engine import Engine

__all__ = ["VERSION", "create_app"]


def create_app(
    engine: Engine,
    serving: OpenAIServing,
    start_engine: bool = True,
    http_stats: HTTPStats | None = None,
) -> FastAPI:
    """The HTTP app; starts/stops the engine with the server when start_engine is set.
    `http_stats` counts the requests whose body timed out (the server's connection metrics)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if start_engine:
            await engine.start()
        writers = getattr(serving, "writers", None)
        if writers is not None and not writers.started:
            writers.start()  # their tokenizers load while the fleet connects
        yield
        if writers is not None:
            writers.stop()
        if start_engine:
            await engine.stop()
        if serving.forwarder is not None:
            await serving.forwarder.close()

    app = FastAPI(title="Tandem", version=VERSION, lifespan=lifespan)
    _add_middleware(app, engine.config, http_stats)
    install_error_handlers(app)
    add_openai_routes(app, engine, serving)
    add_ops_routes(app, engine, serving.admission)
    add_tokens_routes(app, engine, serving)
    return app


def _add_middleware(app: FastAPI, cfg, http_stats: HTTPStats | None) -> None:
    """Each one added wraps the ones before: the request id is outermost (every response,
    401, 403, 408 and 413 included, carries it), then keys are checked before a body is read,
    then the body is read within its time and size bounds."""
    app.add_middleware(BodySizeLimit, max_bytes=getattr(cfg, "max_request_bytes", 0))
    app.add_middleware(
        BodyReadTimeout, timeout=getattr(cfg, "http_body_timeout", 0.0), stats=http_stats
    )
    app.add_middleware(
        APIKeyAuth,
        keys=list(getattr(cfg, "api_keys", ())),
        exempt_paths=getattr(cfg, "auth_exempt_paths", DEFAULT_EXEMPT_PATHS),
    )
    app.add_middleware(AdminAuth, keys=list(getattr(cfg, "admin_api_keys", ())))
    app.add_middleware(RequestIdMiddleware)
