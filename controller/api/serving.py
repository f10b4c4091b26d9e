"""The OpenAI handlers: a validated body in, a response out.

Each stage is bounded before the next one allocates:

1. the body's own sizes (request_limits.py): sequences, stop strings and ids, logprobs, chat
   messages and tools;
2. the prompt: text longer than the token bound can cover is refused before it is tokenized,
   then its token count is bounded;
2a. prefix affinity across controllers (forwarding.py): with peers, a request whose prompt
   hashes to another controller is sent there and its answer passed back;
2b. structured-output constraints (constraints.py): each bounded in size, then compiled off
   the event loop (or found in the cache); a refused one is a 400;
3. admission (admission.py): the request takes its share of the queue bounds, 429 beyond them,
   and keeps it while it waits for an executor;
4. waiting for a healthy executor (waiting.py): at most --no-executor-timeout (then 503); a
   shutdown or the client leaving ends it;
5. the context limits and one GenerationRequest per sequence (building.py);
6. the response, streamed or whole (streaming.py), bounded by the stall timeout.
"""

from __future__ import annotations

import logging
import time

from fastapi import Request as HTTPRequest
from fastapi.responses import Response

from controller.api import formats
from controller.api import request_limits as limits
from controller.api.admission import Admission, AdmissionLimits, AdmissionRejected, Ticket
from controller.api.building import BuildOptions, generation_requests, token_limit
from controller.api.constraints import ConstraintCompiler, grammar_limits
from controller.api.deltas import DeltaQueue
from controller.api.errors import APIError, encodable, quote
from controller.api.formats import Prompt
from controller.api.forwarding import Forwarder
from controller.api.protocol import ChatCompletionRequest, CompletionRequest, _SamplingFields
from controller.api.request_ids import request_ids
from controller.api.streaming import (
    GuardedJSONResponse,
    TicketedStream,
    client_closed,
    collect,
    sse_events,
)
from controller.api.tool_output import tool_policy
from controller.api.waiting import wait_for_executor
from controller.api.writers.pool import WriterPool
from controller.fleet.engine import Engine
from controller.text.grammar import GrammarCompiler
from controller.text.text_bound import chars_per_token_bound, text_limit
from controller.text.tokenizer import Tokenizer
from controller.text.tools import select_format
from controller.text.tools.prompt import prepare_conversation

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
        forwarder: Forwarder | None = None,
        writers: WriterPool | None = None,
    ):
        self.engine = engine  # the engine
        self.writers = writers  # stream writer processes (None: streams are written here)
        self.tokenizer = tokenizer  # the model's tokenizer
        self.model_name = model_name  # served name
        self.admission = admission or Admission(AdmissionLimits())  # queue bounds, shutdown
        self.forwarder = forwarder  # sends a request to its home controller (None: no peers)
        self.limits = limits.RequestLimits.from_config(engine.config, max_logprobs)  # per request
        # Most characters one token covers (None: no such bound for this tokenizer).
        self.chars_per_token = chars_per_token_bound(getattr(tokenizer, "backend", None))
        # Structured-output constraints, compiled (and cached) before a request is queued.
        grammars = GrammarCompiler.for_tokenizer(tokenizer, grammar_limits(engine.config))
        self.constraints = ConstraintCompiler(grammars)
        # How tools are shown to the model and its calls read and constrained.
        self.tool_format = select_format(
            getattr(engine.config, "tool_call_parser", "auto"),
            getattr(tokenizer, "chat_template", None),
        )

    @property
    def max_logprobs(self) -> int:
        """Bound on requested logprobs."""
        return self.limits.max_logprobs

    # --- validation ---------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                f"The model `{quote(model)}` does not exist.", 404, "model", "model_not_found"
            )

    def check_draining(self) -> None:
        """503 at once while the controller shuts down."""
        if self.admission.draining:
            self._admit([])

    def check_text(self, text: str, param: str, tokens: int | None = None) -> None:
        """400 for text longer than `tokens` tokens (default: the request bound) can cover."""
        tokens = self.limits.max_prompt_tokens if tokens is None else tokens
        bound = text_limit(tokens, self.chars_per_token)
        limits.check_text_length(len(text), bound, tokens, param)

    def encode(
        self, text: str, param: str, add_special_tokens: bool = True, tokens: int | None = None
    ) -> list[int]:
        """Token ids of client text, bounded before (its length: what `tokens` tokens, default
        the request bound, can cover) and after (its token count); 400 when it is not valid
        Unicode (lone surrogates)."""
        self.check_text(text, param, tokens)
        try:
            ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except (TypeError, ValueError, UnicodeError) as exc:
            raise APIError(f"{param} is not valid Unicode text", 400, param) from exc
        limits.check_prompt_tokens([len(ids)], self.limits, param)
        return ids

    def render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool,
        tools: list | None = None,
        extra: dict | None = None,
    ) -> str:
        """The chat template applied to client messages; 400 when the template cannot render
        them (the messages, tools and variables are the client's)."""
        limits.check_chat(len(messages), tools, self.limits)
        content = sum(limits.content_chars(m.get("content")) for m in messages)
        tokens = self.limits.max_prompt_tokens
        limits.check_text_length(
            content, text_limit(tokens, self.chars_per_token), tokens, "messages"
        )
        clash = sorted(_RESERVED_TEMPLATE_VARS & set(extra or ()))
        if clash:
            raise APIError(
                f"chat_template_kwargs may not set {quote(', '.join(clash))}",
                400,
                "chat_template_kwargs",
            )
        try:
            messages = self._with_tools(messages, tools)
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tools=tools, **(extra or {})
            )
        except Exception as exc:  # whatever the client's input makes the template raise
            reason = encodable(str(exc), 500)  # the template's words may quote the client's
            raise APIError(f"Cannot apply the chat template: {reason}", 400, "messages") from exc

    def _with_tools(self, messages: list[dict], tools: list | None) -> list[dict]:
        """The messages with the tools' system prompt and past calls in the tool-call
        format's text, where the chat template does not render them itself."""
        template = getattr(self.tokenizer, "get_chat_template", None)
        if template is None:  # a test's fake tokenizer
            return messages
        return prepare_conversation(self.tool_format, messages, tools, template(None, tools))

    def _check_ids(self, ids: list[int], param: str) -> None:
        limits.check_token_ids(ids, self.tokenizer.vocab_size, param)

    def _options(
        self,
        req: _SamplingFields,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_lp: int | None,
        http: HTTPRequest,
    ) -> BuildOptions:
        """The body's sampling extras, bounded: stop strings, stop ids, logit_bias."""
        if getattr(req, "logit_bias", None):
            raise APIError("logit_bias is not supported", 400, "logit_bias")
        return BuildOptions(
            max_tokens=max_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_lp,
            stop=limits.check_stop(req.stop, self.limits),
            stop_token_ids=limits.check_stop_token_ids(
                req.stop_token_ids, self.limits, self.tokenizer.vocab_size
            ),
            base_id=request_ids(http.scope).unique,
        )

    def _max_sequences(self) -> int:
        """Most sequences one request may hold: the request bound, and the queue's."""
        queue = self.admission.limits.max_queued_requests
        return min(self.limits.max_sequences, queue) if queue else self.limits.max_sequences

    def _capacity(self) -> int:
        """Tokens one sequence may hold (prompt + output): the fleet's context and KV room."""
        return min(self.engine.max_model_len, self.engine.num_kv_tokens)

    def _prompt_bound(self) -> int:
        """Most tokens one prompt may have: the request bound, and the context once the fleet
        reported one (a longer prompt fails anyway)."""
        capacity = self._capacity()
        budget = self.limits.max_prompt_tokens
        return min(capacity, budget) if capacity > 0 else budget

    async def _forwarded(self, http: HTTPRequest, tokens: list[int]) -> Response | None:
        """The home controller's answer when this prompt's home is another (forwarding.py)."""
        if self.forwarder is None:
            return None
        stall = self.limits.stream_stall_timeout
        return await self.forwarder.route(http, tokens, self.admission.active, stall)

    # --- admission and waiting ------------------------------------------------------------

    def _admit(self, prompt_tokens: list[int]) -> Ticket:
        """Admit a response's sequences, or raise the APIError that refuses it."""
        try:
            ticket = self.admission.admit(prompt_tokens)
        except AdmissionRejected as exc:
            headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after else None
            raise APIError(exc.message, exc.status, code=exc.code, headers=headers) from None
        log.debug(
            "admitted: %d sequences, %d prompt tokens", len(prompt_tokens), sum(prompt_tokens)
        )
        return ticket

    async def _serve(
        self,
        req: _SamplingFields,
        http: HTTPRequest,
        prompts: list[Prompt],
        opts: BuildOptions,
        fmt,
        param: str,
    ) -> Response:
        """Admit, wait for an executor, build the sequences and answer (streamed or whole)."""
        self.check_draining()
        ticket = self._admit([len(p.token_ids) for p in prompts for _ in range(req.n)])
        queue = DeltaQueue()
        ticket.attach(queue)
        try:
            if not await wait_for_executor(self.engine, queue, http):
                ticket.close()
                return client_closed()
            capacity = self._capacity()
            token_limits = [
                token_limit(opts.max_tokens, len(p.token_ids), capacity, param) for p in prompts
            ]
            gens = generation_requests(
                req,
                prompts,
                token_limits,
                opts,
                self.engine.eos_token_ids,
                self.tokenizer.vocab_size,
            )
        except BaseException:
            ticket.close()
            raise
        stall = self.limits.stream_stall_timeout
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            events = sse_events(
                self.engine,
                gens,
                fmt.stream_chunk,
                fmt,
                include_usage,
                ticket,
                queue,
                self.writers,
            )
            return TicketedStream(
                ticket,
                stall,
                queue,
                events,
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        choices = await collect(self.engine, gens, http, ticket, queue, req.n)
        if choices is None:
            return client_closed()
        return GuardedJSONResponse(fmt.response(choices), stall)

    # --- completions --------------------------------------------------------------------

    def _completion_prompts(self, req: CompletionRequest) -> list[Prompt]:
        """The prompts, bounded in number, text and tokens before and after tokenizing."""
        p = req.prompt
        if isinstance(p, str):
            items: list = [p]
        elif p and isinstance(p[0], int):
            items = [p]
        else:
            items = list(p)
        if not items:
            raise APIError("The prompt is empty.", 400, "prompt")
        limits.check_sequences(len(items), req.n, self._max_sequences())
        given = [len(item) for item in items if not isinstance(item, str)]
        limits.check_prompt_tokens(given, self.limits, "prompt")
        budget = self.limits.max_prompt_tokens
        chars = sum(len(item) for item in items if isinstance(item, str))
        bound = text_limit(budget, self.chars_per_token)
        limits.check_text_length(chars, bound, budget, "prompt")
        per_prompt = self._prompt_bound()
        out = []
        for item in items:
            if isinstance(item, str):
                out.append(Prompt(self.encode(item, "prompt", tokens=per_prompt), item))
            else:
                self._check_ids(item, "prompt")
                out.append(Prompt(list(item), None))
        limits.check_prompt_tokens([len(x.token_ids) for x in out], self.limits, "prompt")
        return out

    async def completions(self, req: CompletionRequest, http: HTTPRequest):
        self.check_model(req.model)
        if req.suffix:
            raise APIError("suffix is not supported", 400, "suffix")
        if req.best_of not in (None, req.n):
            raise APIError("best_of must equal n", 400, "best_of")
        limits.check_logprobs(req.logprobs, "logprobs", self.limits)
        prompt_lp = req.logprobs if req.echo and req.logprobs is not None else None
        opts = self._options(req, req.max_tokens, req.logprobs, prompt_lp, http)
        self.check_draining()
        prompts = self._completion_prompts(req)
        forwarded = await self._forwarded(http, prompts[0].token_ids)
        if forwarded is not None:
            return forwarded
        opts.grammars = await self.constraints.request_grammars(
            req.response_format, req.structured_outputs
        )
        meta = formats.ResponseMeta(
            f"cmpl-{request_ids(http.scope).public}", int(time.time()), self.model_name
        )
        fmt = formats.CompletionFormatter(
            self.tokenizer, meta, prompts, req.n, req.echo, req.logprobs, req.return_token_ids
        )
        return await self._serve(req, http, prompts, opts, fmt, "prompt")

    # --- chat ---------------------------------------------------------------------------

    async def chat(self, req: ChatCompletionRequest, http: HTTPRequest):
        self.check_model(req.model)
        top = req.top_logprobs
        if top is not None and not req.logprobs:
            raise APIError("top_logprobs requires logprobs to be true", 400, "top_logprobs")
        limits.check_logprobs(top, "top_logprobs", self.limits)
        limits.check_sequences(1, req.n, self._max_sequences())
        logprobs = (top or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens or req.max_tokens
        opts = self._options(req, max_tokens, logprobs, None, http)
        self.check_draining()
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        tools = None if req.tools is None else [t.model_dump(exclude_none=True) for t in req.tools]
        shown = None if req.tool_choice == "none" else tools  # "none": the model sees none
        text = self.render_chat(
            messages, req.add_generation_prompt, shown, req.chat_template_kwargs
        )
        ids = self.encode(text, "messages", add_special_tokens=False, tokens=self._prompt_bound())
        forwarded = await self._forwarded(http, ids)
        if forwarded is not None:
            return forwarded
        opts.grammars = await self.constraints.request_grammars(
            req.response_format,
            req.structured_outputs,
            req.tools,
            req.tool_choice,
            req.parallel_tool_calls,
            self.tool_format,
        )
        prompt = Prompt(ids, text)
        meta = formats.ResponseMeta(
            f"chatcmpl-{request_ids(http.scope).public}", int(time.time()), self.model_name
        )
        policy = tool_policy(self.tool_format, req.tools, req.tool_choice, req.parallel_tool_calls)
        fmt = formats.ChatFormatter(
            self.tokenizer, meta, prompt, req.logprobs, req.return_token_ids, policy
        )
        return await self._serve(req, http, [prompt], opts, fmt, "messages")
