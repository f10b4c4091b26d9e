"""The OpenAI routes: completions, chat completions, models."""

from __future__ import annotations

import time

from fastapi import FastAPI, Request

from controller.api.protocol import ChatCompletionRequest, CompletionRequest
from controller.api.serving import OpenAIServing
from controller.fleet.engine import Engine


def add_openai_routes(app: FastAPI, engine: Engine, serving: OpenAIServing) -> None:
    """/v1/completions, /v1/chat/completions and /v1/models."""

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await serving.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await serving.chat(body, request)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(engine, serving.model_name)]}


def _model_card(engine: Engine, model_name: str) -> dict:
    """The served model, with how many executors serve it."""
    states = engine.executors_state()
    kinds: dict[str, int] = {}
    for e in states:
        if e["healthy"]:
            kinds[e["kind"]] = kinds.get(e["kind"], 0) + 1
    return {
        "id": model_name,
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
