"""The FastAPI application: routes, error mapping, lifecycle."""

from __future__ import annotations

import contextlib
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from controller.api.auth import DEFAULT_EXEMPT_PATHS, APIKeyAuth
from controller.api.errors import APIError, error_response
from controller.api.limits import BodySizeLimit
from controller.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from controller.api.serving import OpenAIServing
from controller.fleet.engine import Engine

log = logging.getLogger(__name__)
VERSION = "0.1.0"
# What /health shows per executor (the admin endpoint shows everything).
_HEALTH_FIELDS = (
    "address",
    "state",
    "healthy",
    "kind",
    "incarnation",
    "running",
    "waiting",
    "kv_usage",
    "used_blocks",
)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "Invalid request.", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return "The request body is not valid JSON.", None
    param = ".".join(loc) or None
    return f"{param or 'body'}: {first.get('msg', 'invalid value')}", param


def create_app(engine: Engine, serving: OpenAIServing, start_engine: bool = True) -> FastAPI:
    """The HTTP app; starts/stops the engine with the server when start_engine is set."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if start_engine:
            await engine.start()
        yield
        if start_engine:
            await engine.stop()

    app = FastAPI(title="Tandem", version=VERSION, lifespan=lifespan)
    cfg = engine.config
    # Outermost first: keys are checked before a body is read.
    app.add_middleware(BodySizeLimit, max_bytes=getattr(cfg, "max_request_bytes", 0))
    app.add_middleware(
        APIKeyAuth,
        keys=list(getattr(cfg, "api_keys", ())),
        exempt_paths=getattr(cfg, "auth_exempt_paths", DEFAULT_EXEMPT_PATHS),
    )
    admission = serving.admission

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error_response(APIError(message, 400, param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return error_response(APIError(str(exc.detail), exc.status_code))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return error_response(APIError("Internal server error.", 500))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await serving.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await serving.chat(body, request)

    @app.get("/v1/models")
    async def models():
        states = engine.executors_state()
        kinds: dict[str, int] = {}
        for e in states:
            if e["healthy"]:
                kinds[e["kind"]] = kinds.get(e["kind"], 0) + 1
        return {
            "object": "list",
            "data": [
                {
                    "id": serving.model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "tandem",
                    "root": engine.config.model,
                    "max_model_len": engine.max_model_len,
                    "executors": {
                        "total": len(states),
                        "healthy": sum(kinds.values()),
                        "healthy_by_kind": kinds,
                    },
                }
            ],
        }

    @app.get("/health")
    async def health():
        states = engine.executors_state()
        ok = engine.healthy and not admission.draining
        status = "draining" if admission.draining else "ok" if ok else "unavailable"
        state = {
            "status": status,
            "healthy_executors": sum(e["healthy"] for e in states),
            "executors": [{k: e[k] for k in _HEALTH_FIELDS} for e in states],
        }
        return JSONResponse(state, status_code=200 if ok else 503)

    @app.get("/admin/executors")
    async def executors():
        return {
            "executors": engine.executors_state(),
            "requests_waiting_for_executor": len(engine.waiting),
            "summary": engine.fleet_summary(),
            "admission": {
                "active_responses": admission.active,
                "queued_requests": admission.queued_requests,
                "queued_tokens": admission.queued_tokens,
                "rejected": admission.rejected,
                "draining": admission.draining,
            },
        }

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version():
        return {"version": VERSION}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("Give exactly one of prompt or messages.", 400, "prompt")
        if body.messages is not None:
            text = serving.render_chat(
                [m.model_dump(exclude_none=True) for m in body.messages], body.add_generation_prompt
            )
            ids = serving.encode(text, "messages", add_special_tokens=False)
        else:
            ids = serving.encode(body.prompt, "prompt", body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        serving.check_model(body.model)
        serving._check_ids(body.tokens, "tokens")
        return {"prompt": serving.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    return app
