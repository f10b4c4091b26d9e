"""Turns validated API requests into engine requests and engine deltas into OpenAI responses."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from common.wire.request_ids import sequence_id
from common.wire.step_types import SamplingParams
from controller.api import formats
from controller.api.admission import ABORT, Admission, AdmissionLimits, AdmissionRejected, Ticket
from controller.api.errors import APIError
from controller.api.formats import Choice, Prompt
from controller.api.protocol import ChatCompletionRequest, CompletionRequest, _SamplingFields
from controller.api.request_ids import request_ids
from controller.core.outputs import GenerationRequest, OutputDelta
from controller.fleet.engine import Engine, NoExecutorError
from controller.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)
# Template inputs the server sets itself; chat_template_kwargs may not override them.
_RESERVED_TEMPLATE_VARS = frozenset(
    {"messages", "add_generation_prompt", "tools", "documents", "chat_template"}
)


class OpenAIServing:
    """Handlers for /v1/completions and /v1/chat/completions."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        model_name: str,
        max_logprobs: int,
        admission: Admission | None = None,
    ):
        self.engine = engine  # the engine
        self.tokenizer = tokenizer  # the model's tokenizer
        self.model_name = model_name  # served name
        self.max_logprobs = max_logprobs  # bound on requested logprobs
        self.admission = admission or Admission(AdmissionLimits())  # queue bounds, shutdown

    # --- validation ---------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(f"The model `{model}` does not exist.", 404, "model", "model_not_found")

    def check_draining(self) -> None:
        """503 at once while the controller shuts down."""
        if self.admission.draining:
            self._admit([])

    def _admit(self, gens: list[GenerationRequest]) -> Ticket:
        """Admit a response's sequences, or raise the APIError that refuses it."""
        prompt_tokens = [len(g.prompt_token_ids) for g in gens]
        try:
            ticket = self.admission.admit(prompt_tokens)
        except AdmissionRejected as exc:
            headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after else None
            raise APIError(exc.message, exc.status, code=exc.code, headers=headers) from None
        log.debug("admitted: %d sequences, %d prompt tokens", len(gens), sum(prompt_tokens))
        return ticket

    async def wait_for_executor(self) -> None:
        """Hold the request until some executor is healthy; 503 after the fleet's timeout."""
        if not await self.engine.wait_for_executor():
            raise APIError(self.engine.no_executor_message(), 503, code="no_healthy_executor")

    def _check_logprobs(self, k: int | None, param: str) -> None:
        if k is not None and k > self.max_logprobs:
            raise APIError(f"{param} must be at most {self.max_logprobs}", 400, param)

    def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of client text; 400 when it is not valid Unicode (lone surrogates)."""
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except (TypeError, ValueError, UnicodeError) as exc:
            raise APIError(f"{param} is not valid Unicode text: {exc}", 400, param) from exc

    def render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool,
        tools: list | None = None,
        extra: dict | None = None,
    ) -> str:
        """The chat template applied to client messages; 400 when the template cannot render
        them (the messages, tools and variables are the client's)."""
        clash = sorted(_RESERVED_TEMPLATE_VARS & set(extra or ()))
        if clash:
            raise APIError(
                f"chat_template_kwargs may not set {', '.join(clash)}", 400, "chat_template_kwargs"
            )
        try:
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tools=tools, **(extra or {})
            )
        except Exception as exc:  # whatever the client's input makes the template raise
            raise APIError(f"Cannot apply the chat template: {exc}", 400, "messages") from exc

    def _check_ids(self, ids: list[int], param: str) -> None:
        vocab = self.tokenizer.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise APIError(f"{param} holds token ids outside [0, {vocab})", 400, param)

    def _max_tokens(self, requested: int | None, prompt_len: int) -> int:
        limit = self.engine.max_model_len
        if prompt_len == 0:
            raise APIError("The prompt is empty.", 400, "prompt")
        capacity = min(limit, self.engine.num_kv_tokens)
        if requested is None:
            requested = capacity - prompt_len
            if requested < 1:
                raise APIError(
                    f"This model's maximum context length is {capacity} tokens. However, your "
                    f"prompt has {prompt_len} tokens.",
                    400,
                    "messages",
                    "context_length_exceeded",
                )
            return requested
        if prompt_len + requested > capacity:
            raise APIError(
                f"This model's maximum context length is {capacity} tokens. However, you "
                f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, "
                f"{requested} in the completion). Please reduce the prompt or max_tokens.",
                400,
                "max_tokens",
                "context_length_exceeded",
            )
        return requested

    def _sampling(
        self, req: _SamplingFields, logprobs: int | None, prompt_lp: int | None, seed_offset: int
    ) -> SamplingParams:
        temperature = 1.0 if req.temperature is None else req.temperature
        top_k = max(0, req.top_k or 0)
        return SamplingParams(
            temperature=temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if top_k >= self.tokenizer.vocab_size else top_k,  # all tokens: off
            min_p=req.min_p or 0.0,
            seed=None if req.seed is None else req.seed + seed_offset,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logprobs=logprobs,
            prompt_logprobs=prompt_lp,
        )

    def _generation_requests(
        self,
        req: _SamplingFields,
        prompts: list[Prompt],
        max_tokens: int | None,
        logprobs: int | None,
        prompt_lp: int | None,
        base: str,
    ) -> list[GenerationRequest]:
        """The sequences of a request whose unique id is ``base``, prompt after prompt."""
        if getattr(req, "logit_bias", None):
            raise APIError("logit_bias is not supported", 400, "logit_bias")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        stop_ids = list(req.stop_token_ids or [])
        self._check_ids(stop_ids, "stop_token_ids")
        gens = []
        # Ids that end a request; the executor never samples them before min_tokens.
        ending = stop_ids + ([] if req.ignore_eos else list(self.engine.eos_token_ids))
        for p_index, prompt in enumerate(prompts):
            self._check_ids(prompt.token_ids, "prompt")
            limit = self._max_tokens(max_tokens, len(prompt.token_ids))
            for j in range(req.n):
                sampling = self._sampling(req, logprobs, prompt_lp, j)
                min_tokens = min(req.min_tokens, limit)
                if min_tokens:
                    sampling.min_tokens, sampling.stop_token_ids = min_tokens, ending
                gens.append(
                    GenerationRequest(
                        request_id=sequence_id(base, p_index, j),
                        prompt_token_ids=prompt.token_ids,
                        sampling=sampling,
                        max_tokens=limit,
                        min_tokens=min_tokens,
                        stop=stop,
                        stop_token_ids=stop_ids,
                        ignore_eos=req.ignore_eos,
                        include_stop_str_in_output=req.include_stop_str_in_output,
                        skip_special_tokens=req.skip_special_tokens,
                        priority=req.priority,
                        stream=bool(req.stream),
                    )
                )
        return gens

    # --- running ------------------------------------------------------------------------

    async def _run(
        self, gens: list[GenerationRequest], ticket: Ticket
    ) -> AsyncIterator[tuple[int, OutputDelta]]:
        """Run all requests concurrently; yield (index, delta) as they come; abort on exit.

        When the ticket is aborted (shutdown), every unfinished request ends with "abort".
        """
        queue: asyncio.Queue = asyncio.Queue()
        ticket.attach(queue)

        async def pump(i: int, gen: GenerationRequest) -> None:
            try:
                async with contextlib.aclosing(self.engine.generate(gen)) as stream:
                    async for delta in stream:
                        queue.put_nowait((i, delta))
            except Exception as exc:  # surfaced to the handler
                queue.put_nowait((i, exc))

        tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
        finished = [False] * len(gens)
        try:
            remaining = len(gens)
            while remaining:
                i, item = await queue.get()
                if item is ABORT:
                    for j, gen in enumerate(gens):
                        if not finished[j]:
                            yield (
                                j,
                                OutputDelta(gen.request_id, finished=True, finish_reason="abort"),
                            )
                    return
                ticket.started(i)
                if isinstance(item, NoExecutorError):
                    raise APIError(str(item), 503, code="no_healthy_executor")
                if isinstance(item, Exception):
                    raise item
                if item.finished:
                    remaining -= 1
                    finished[i] = True
                yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _collect(
        self, gens: list[GenerationRequest], http: HTTPRequest, ticket: Ticket
    ) -> list[Choice] | None:
        """Run to completion (non-streaming); abort everything and return None if the client
        leaves."""
        choices = [Choice(index=i, prompt_index=0) for i in range(len(gens))]

        async def collect() -> list[Choice]:
            async with contextlib.aclosing(self._run(gens, ticket)) as deltas:
                async for i, d in deltas:
                    choices[i].add(d)
            return choices

        task = asyncio.create_task(collect())
        gone = asyncio.create_task(_client_gone(http))
        try:
            done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                return task.result()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return None
        finally:
            gone.cancel()
            if not task.done():
                task.cancel()
            ticket.close()

    # --- completions --------------------------------------------------------------------

    def _completion_prompts(self, req: CompletionRequest) -> list[Prompt]:
        p = req.prompt
        if isinstance(p, str):
            items: list = [p]
        elif p and isinstance(p[0], int):
            items = [p]
        else:
            items = list(p)
        if not items:
            raise APIError("The prompt is empty.", 400, "prompt")
        out = []
        for item in items:
            if isinstance(item, str):
                out.append(Prompt(self.encode(item, "prompt"), item))
            else:
                out.append(Prompt(list(item), None))
        return out

    async def completions(self, req: CompletionRequest, http: HTTPRequest):
        self.check_model(req.model)
        if req.suffix:
            raise APIError("suffix is not supported", 400, "suffix")
        if req.best_of not in (None, req.n):
            raise APIError("best_of must equal n", 400, "best_of")
        self._check_logprobs(req.logprobs, "logprobs")
        self.check_draining()
        await self.wait_for_executor()
        prompts = self._completion_prompts(req)
        prompt_lp = req.logprobs if req.echo and req.logprobs is not None else None
        ids = request_ids(http.scope)
        gens = self._generation_requests(
            req, prompts, req.max_tokens, req.logprobs, prompt_lp, ids.unique
        )
        meta = formats.ResponseMeta(f"cmpl-{ids.public}", int(time.time()), self.model_name)
        fmt = formats.CompletionFormatter(
            self.tokenizer, meta, prompts, req.n, req.echo, req.logprobs, req.return_token_ids
        )
        ticket = self._admit(gens)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return self._sse(gens, fmt.stream_chunk, fmt, include_usage, ticket)
        choices = await self._collect(gens, http, ticket)
        if choices is None:
            return _client_closed()
        for c in choices:
            c.prompt_index = c.index // req.n
        return JSONResponse(fmt.response(choices))

    # --- chat ---------------------------------------------------------------------------

    async def chat(self, req: ChatCompletionRequest, http: HTTPRequest):
        self.check_model(req.model)
        top = req.top_logprobs
        if top is not None and not req.logprobs:
            raise APIError("top_logprobs requires logprobs to be true", 400, "top_logprobs")
        self._check_logprobs(top, "top_logprobs")
        self.check_draining()
        await self.wait_for_executor()
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        text = self.render_chat(
            messages, req.add_generation_prompt, req.tools, req.chat_template_kwargs
        )
        prompt = Prompt(self.encode(text, "messages", add_special_tokens=False), text)
        logprobs = (top or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens or req.max_tokens
        ids = request_ids(http.scope)
        gens = self._generation_requests(req, [prompt], max_tokens, logprobs, None, ids.unique)
        meta = formats.ResponseMeta(f"chatcmpl-{ids.public}", int(time.time()), self.model_name)
        fmt = formats.ChatFormatter(
            self.tokenizer, meta, prompt, req.logprobs, req.return_token_ids
        )
        ticket = self._admit(gens)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return self._sse(gens, fmt.stream_chunk, fmt, include_usage, ticket)
        choices = await self._collect(gens, http, ticket)
        if choices is None:
            return _client_closed()
        return JSONResponse(fmt.response(choices))

    # --- streaming ----------------------------------------------------------------------

    def _sse(
        self,
        gens: list[GenerationRequest],
        chunk: Callable,
        fmt,
        include_usage: bool,
        ticket: Ticket,
    ) -> StreamingResponse:
        choices = [Choice(index=i, prompt_index=i // max(1, fmt.n)) for i in range(len(gens))]

        async def events() -> AsyncIterator[str]:
            try:
                async with contextlib.aclosing(self._run(gens, ticket)) as deltas:
                    for prelude in fmt.stream_prelude(len(gens), include_usage):
                        yield _sse_line(prelude)
                    async for i, d in deltas:
                        first = not choices[i].token_ids and not choices[i].text
                        choices[i].add(d)
                        if d.error:
                            yield _sse_line(
                                {
                                    "error": {
                                        "message": d.error,
                                        "type": "server_error",
                                        "param": None,
                                        "code": None,
                                    }
                                }
                            )
                            continue
                        body = chunk(choices[i], d, first, include_usage)
                        if body is not None:
                            yield _sse_line(body)
                    if include_usage:
                        yield _sse_line(fmt.usage_chunk(choices))
            except APIError as err:
                yield _sse_line(
                    {
                        "error": {
                            "message": err.message,
                            "type": err.err_type,
                            "param": err.param,
                            "code": err.code,
                        }
                    }
                )
            yield "data: [DONE]\n\n"

        return _TicketedStream(
            ticket, events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )


class _TicketedStream(StreamingResponse):
    """A streamed response that releases its admission ticket however it ends (even when
    the client leaves before the body starts)."""

    def __init__(self, ticket: Ticket, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ticket = ticket  # released when the response is over

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.ticket.close()


def _sse_line(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def _client_closed() -> Response:
    """What a handler returns once its client has left: nothing reaches the closed socket, and
    the access log shows 499 (the status proxies use for "client closed request")."""
    return Response(status_code=499)


async def _client_gone(http: HTTPRequest) -> None:
    """Return when the client disconnects. The body has been read, so the server's next ASGI
    message is the disconnect: waiting for it costs nothing, where polling
    ``is_disconnected`` cost every waiting request a wake-up twice a second."""
    while (await http.receive())["type"] != "http.disconnect":
        pass
