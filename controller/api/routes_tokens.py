"""Tokenizer routes: /tokenize and /detokenize."""

from __future__ import annotations

from fastapi import FastAPI

from controller.api.errors import APIError
from controller.api.protocol import DetokenizeRequest, TokenizeRequest
from controller.api.request_limits import check_prompt_tokens
from controller.api.serving import OpenAIServing
from controller.fleet.engine import Engine


def add_tokens_routes(app: FastAPI, engine: Engine, serving: OpenAIServing) -> None:
    """/tokenize (a prompt or chat messages) and /detokenize (token ids), bounded like the
    prompts of a generation request."""

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
        check_prompt_tokens([len(body.tokens)], serving.limits, "tokens")
        serving._check_ids(body.tokens, "tokens")
        return {"prompt": serving.tokenizer.decode(body.tokens, skip_special_tokens=False)}
