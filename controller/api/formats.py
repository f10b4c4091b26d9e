"""OpenAI response bodies for completions and chat completions (whole and streamed)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.wire.step_types import TokenLogprobs
from controller.api.choice import Choice
from controller.api.errors import APIError
from controller.api.sse import ChunkTemplate
from controller.api.tool_output import ToolPolicy, ToolStream
from controller.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from controller.core.outputs import OutputDelta


@dataclass
class Prompt:
    """A tokenized prompt."""

    token_ids: list[int]  # token ids
    text: str | None  # the text, when given as text


@dataclass
class ResponseMeta:
    """Fields every body of one response repeats."""

    id: str  # response id
    created: int  # unix seconds
    model: str  # served model name


class TokenText:
    """Text of single tokens for logprobs, cached."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text


def _raise_errors(choices: list[Choice]) -> None:
    for c in choices:
        if c.error:
            raise APIError(f"Generation failed: {c.error}", 500, code="generation_failed")


def _usage(prompt_tokens: int, choices: list[Choice]) -> dict:
    completion = sum(len(c.token_ids) for c in choices)
    cached = sum(c.num_cached_tokens for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class CompletionFormatter:
    """Bodies of /v1/completions."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        meta: ResponseMeta,
        prompts: list[Prompt],
        n: int,
        echo: bool,
        logprobs: int | None,
        return_token_ids: bool = False,
    ):
        self.return_token_ids = return_token_ids
        self.meta = meta
        self.prompts = prompts
        self.n = n
        self.echo = echo
        self.logprobs = logprobs
        self.tokenizer = tokenizer
        self.token_text = TokenText(tokenizer)
        self.template = ChunkTemplate(meta.id, "text_completion", meta.created, meta.model)

    def _prompt_text(self, prompt: Prompt) -> str:
        if prompt.text is not None:
            return prompt.text
        return self.tokenizer.decode(prompt.token_ids, skip_special_tokens=False)

    def _logprobs(
        self, entries: list[tuple[int, float | None, TokenLogprobs | None]], offset: int
    ) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        for token_id, lp, full in entries:
            text = self.token_text(token_id)
            tokens.append(text)
            token_lps.append(lp)
            if full is None:
                tops.append(None)
            else:
                top = {self.token_text(t): v for t, v in zip(full.top_token_ids, full.top_logprobs)}
                top.setdefault(text, full.logprob)
                tops.append(top)
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _entries(self, lps: list[TokenLogprobs]):
        return [(lp.token_id, lp.logprob, lp) for lp in lps]

    def _choice_logprobs(self, choice: Choice) -> dict | None:
        if self.logprobs is None:
            return None
        entries = []
        if self.echo:
            prompt = self.prompts[choice.prompt_index]
            entries.append((prompt.token_ids[0], None, None))
            entries.extend(self._entries(choice.prompt_logprobs))
        entries.extend(self._entries(choice.logprobs))
        return self._logprobs(entries, 0)

    def response(self, choices: list[Choice]) -> dict:
        _raise_errors(choices)
        body = []
        for c in choices:
            text = c.text
            if self.echo:
                text = self._prompt_text(self.prompts[c.prompt_index]) + text
            item = {
                "index": c.index,
                "text": text,
                "logprobs": self._choice_logprobs(c),
                "finish_reason": c.finish_reason,
            }
            if self.return_token_ids:
                item["prompt_token_ids"] = self.prompts[c.prompt_index].token_ids
                item["token_ids"] = c.token_ids
            body.append(item)
        prompt_tokens = sum(len(p.token_ids) for p in self.prompts)
        return {
            "id": self.meta.id,
            "object": "text_completion",
            "created": self.meta.created,
            "model": self.meta.model,
            "choices": body,
            "usage": _usage(prompt_tokens, choices),
        }

    def stream_prelude(self, num_choices: int, include_usage: bool) -> list[dict]:
        return []

    def stream_bytes(
        self, choice: Choice, d: OutputDelta, first: bool, include_usage: bool
    ) -> bytes | None:
        """The SSE event of a plain delta (no logprobs, no echoed prompt) from the template,
        b"" when it says nothing; None: not plain, `stream_chunk` builds it."""
        if self.logprobs is not None or (first and self.echo):
            return None
        if not d.text and not d.finished:
            return b""
        reason = d.finish_reason if d.finished else None
        ids = d.token_ids if self.return_token_ids else None
        return self.template.completion(choice.index, d.text, reason, ids, include_usage)

    def stream_chunk(
        self, choice: Choice, d: OutputDelta, first: bool, include_usage: bool
    ) -> dict | None:
        text = d.text
        entries = []
        if first and self.echo:
            prompt = self.prompts[choice.prompt_index]
            text = self._prompt_text(prompt) + text
            if self.logprobs is not None:
                entries.append((prompt.token_ids[0], None, None))
        if self.logprobs is not None:
            entries.extend(self._entries(d.prompt_logprobs or []))
            entries.extend(self._entries(d.logprobs or []))
        if not text and not entries and not d.finished:
            return None
        body = {
            "id": self.meta.id,
            "object": "text_completion",
            "created": self.meta.created,
            "model": self.meta.model,
            "choices": [
                {
                    "index": choice.index,
                    "text": text,
                    "logprobs": self._logprobs(entries, 0) if entries else None,
                    "finish_reason": d.finish_reason if d.finished else None,
                }
            ],
        }
        if self.return_token_ids:
            body["choices"][0]["token_ids"] = d.token_ids
        if include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, choices: list[Choice]) -> dict:
        prompt_tokens = sum(len(p.token_ids) for p in self.prompts)
        return {
            "id": self.meta.id,
            "object": "text_completion",
            "created": self.meta.created,
            "model": self.meta.model,
            "choices": [],
            "usage": _usage(prompt_tokens, choices),
        }


class ChatFormatter:
    """Bodies of /v1/chat/completions."""

    n = 1  # choices are indexed directly

    def __init__(
        self,
        tokenizer: Tokenizer,
        meta: ResponseMeta,
        prompt: Prompt,
        logprobs: bool,
        return_token_ids: bool = False,
        tools: ToolPolicy | None = None,
    ):
        self.return_token_ids = return_token_ids
        self.meta = meta
        self.prompt = prompt
        self.logprobs = logprobs
        self.token_text = TokenText(tokenizer)
        # Reads tool calls out of the output (None: the output is plain text).
        self.tools = tools
        self._tool_stream = None if tools is None else ToolStream(tools)
        self.template = ChunkTemplate(meta.id, "chat.completion.chunk", meta.created, meta.model)

    def _content_logprobs(self, lps: list[TokenLogprobs]) -> list[dict]:
        out = []
        for lp in lps:
            text = self.token_text(lp.token_id)
            out.append(
                {
                    "token": text,
                    "logprob": lp.logprob,
                    "bytes": list(text.encode("utf-8")),
                    "top_logprobs": [
                        {
                            "token": self.token_text(t),
                            "logprob": v,
                            "bytes": list(self.token_text(t).encode("utf-8")),
                        }
                        for t, v in zip(lp.top_token_ids, lp.top_logprobs)
                    ],
                }
            )
        return out

    def _chunk(self, choices: list[dict], include_usage: bool) -> dict:
        body = {
            "id": self.meta.id,
            "object": "chat.completion.chunk",
            "created": self.meta.created,
            "model": self.meta.model,
            "choices": choices,
        }
        if include_usage:
            body["usage"] = None
        return body

    def response(self, choices: list[Choice]) -> dict:
        _raise_errors(choices)
        body = []
        for c in choices:
            lp = {"content": self._content_logprobs(c.logprobs)} if self.logprobs else None
            message, reason = {"role": "assistant", "content": c.text}, c.finish_reason
            if self.tools is not None:
                message, reason = self.tools.message(c.text, c.finish_reason)
            item = {"index": c.index, "message": message, "logprobs": lp, "finish_reason": reason}
            if self.return_token_ids:
                item["prompt_token_ids"] = self.prompt.token_ids
                item["token_ids"] = c.token_ids
            body.append(item)
        return {
            "id": self.meta.id,
            "object": "chat.completion",
            "created": self.meta.created,
            "model": self.meta.model,
            "choices": body,
            "usage": _usage(len(self.prompt.token_ids), choices),
        }

    def stream_prelude(self, num_choices: int, include_usage: bool) -> list[dict]:
        return [
            self._chunk(
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
                include_usage,
            )
            for i in range(num_choices)
        ]

    def stream_bytes(
        self, choice: Choice, d: OutputDelta, first: bool, include_usage: bool
    ) -> bytes | None:
        """The SSE event of a plain delta (no logprobs, no tools) from the template, b"" when
        it says nothing; None: not plain, `stream_chunk` builds it."""
        if self.logprobs or self._tool_stream is not None:
            return None
        if not d.text and not d.finished and not d.token_ids:
            return b""
        reason = d.finish_reason if d.finished else None
        ids = d.token_ids if self.return_token_ids else None
        return self.template.chat(choice.index, d.text, reason, ids, include_usage)

    def stream_chunk(
        self, choice: Choice, d: OutputDelta, first: bool, include_usage: bool
    ) -> dict | list[dict] | None:
        """The chunk of one delta; several when it completes tool calls (two per call)."""
        if not d.text and not d.finished and not d.token_ids:
            return None
        reason = d.finish_reason if d.finished else None
        if self._tool_stream is None:
            deltas = [{"content": d.text} if d.text else {}]
        else:
            deltas = self._tool_stream.deltas(choice.index, d.text, d.finished) or [{}]
            reason = self._tool_stream.finish_reason(choice.index, reason)
        lp = {"content": self._content_logprobs(d.logprobs or [])} if self.logprobs else None
        chunks = []
        for k, delta in enumerate(deltas):
            last = k == len(deltas) - 1
            item = {
                "index": choice.index,
                "delta": delta,
                "logprobs": lp if k == 0 else None,
                "finish_reason": reason if last else None,
            }
            if self.return_token_ids:
                item["token_ids"] = d.token_ids if k == 0 else []
            chunks.append(self._chunk([item], include_usage))
        return chunks[0] if len(chunks) == 1 else chunks

    def usage_chunk(self, choices: list[Choice]) -> dict:
        body = self._chunk([], False)
        body["usage"] = _usage(len(self.prompt.token_ids), choices)
        return body
