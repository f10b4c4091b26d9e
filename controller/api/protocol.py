"""Request bodies of the OpenAI API, validated by pydantic (ranges answer 400, not 5xx)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_N = 16  # most choices per prompt


class StreamOptions(BaseModel):
    """Streaming extras."""

    include_usage: bool = False  # send a final chunk with token usage


class _SamplingFields(BaseModel):
    """Sampling fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None  # must name the served model when given
    max_tokens: int | None = Field(default=None, ge=1)  # None = up to the context limit
    n: int = Field(default=1, ge=1, le=MAX_N)  # choices per prompt
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)  # None = 1.0
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)  # nucleus mass
    top_k: int | None = Field(default=None, ge=-1)  # -1 or 0 = off
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)  # 0 = off
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)  # per-request seed
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)  # 1 = off
    stop: str | list[str] | None = None  # stop strings, not included in the output
    stop_token_ids: list[int] | None = None  # token ids that stop generation
    ignore_eos: bool = False  # do not stop at EOS
    min_tokens: int = Field(default=0, ge=0)  # no EOS/stop ids before this many tokens
    include_stop_str_in_output: bool = False  # keep the matched stop string
    skip_special_tokens: bool = True  # leave special tokens out of the text
    stream: bool = False  # server-sent events
    stream_options: StreamOptions | None = None  # streaming extras
    priority: int = 0  # lower = earlier (priority policy only)
    return_token_ids: bool = False  # add prompt_token_ids / token_ids to each choice
    user: str | None = None  # accepted, unused

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v):
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > 16:
            raise ValueError("at most 16 stop strings")
        if any(s == "" for s in items):
            raise ValueError("stop strings must not be empty")
        return v


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]  # text(s) or token id list(s)
    echo: bool = False  # prepend the prompt to the output (with its logprobs)
    logprobs: int | None = Field(default=None, ge=0)  # top logprobs per token
    suffix: str | None = None  # unsupported unless None
    best_of: int | None = None  # unsupported unless None or n
    logit_bias: dict[str, float] | None = None  # unsupported unless empty
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions


class ChatMessage(BaseModel):
    """One message of a conversation."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None  # text, or text parts

    @field_validator("content")
    @classmethod
    def _check_parts(cls, v):
        if isinstance(v, list):
            for part in v:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("only text content parts are supported")
        return v


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)  # the conversation
    logprobs: bool = False  # return logprobs of the output tokens
    top_logprobs: int | None = Field(default=None, ge=0)  # alternatives per token
    max_completion_tokens: int | None = Field(default=None, ge=1)  # newer name of max_tokens
    add_generation_prompt: bool = True  # end the prompt with the assistant's turn
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables
    logit_bias: dict[str, float] | None = None  # unsupported unless empty
    tools: list[dict[str, Any]] | None = None  # passed to the template


class TokenizeRequest(BaseModel):
    """POST /tokenize: a prompt or a conversation."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[int]
