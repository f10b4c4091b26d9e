"""Request bodies of the OpenAI API, validated by pydantic (ranges answer 400, not 5xx)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from controller.api.shapes import check_prompt_shape
from controller.api.structured import ChatTool, ResponseFormat, StructuredOutputs, ToolChoice

MAX_N = 16  # most choices per prompt
# Integers bound for int32 fields of the executor protocol (or compared with them) must fit.
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Hard caps on list shapes, checked on the raw JSON before pydantic validates every item (one
# bad item in a list of 300,000 made pydantic build 300,000 errors: a second and a half). The
# configurable bounds (--max-request-sequences, --max-request-prompt-tokens) apply after.
MAX_PROMPTS = 1 << 16  # prompts in one request, whatever the settings
MAX_PROMPT_IDS = 1 << 22  # token ids in one request's prompts (a 4 MiB body holds ~2M)
MAX_TOOLS = 1 << 14  # tools in one request, whatever the settings (each is a typed model)


class StreamOptions(BaseModel):
    """Streaming extras."""

    include_usage: bool = False  # send a final chunk with token usage


class _SamplingFields(BaseModel):
    """Sampling fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None  # must name the served model when given
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)  # None = up to the context
    n: int = Field(default=1, ge=1, le=MAX_N)  # choices per prompt
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)  # None = 1.0
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)  # nucleus mass
    top_k: int | None = Field(default=None, ge=-1)  # -1 or 0 = off; >= the vocabulary: off
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)  # 0 = off
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)  # per-request seed
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)  # 1 = off
    stop: str | list[str] | None = None  # stop strings, not included in the output
    stop_token_ids: list[int] | None = None  # token ids that stop generation
    ignore_eos: bool = False  # do not stop at EOS
    min_tokens: int = Field(default=0, ge=0, le=INT32_MAX)  # no EOS/stop ids before this many
    include_stop_str_in_output: bool = False  # keep the matched stop string
    skip_special_tokens: bool = True  # leave special tokens out of the text
    stream: bool = False  # server-sent events
    stream_options: StreamOptions | None = None  # streaming extras
    priority: int = Field(default=0, ge=INT64_MIN, le=INT64_MAX)  # lower = earlier (policy)
    return_token_ids: bool = False  # add prompt_token_ids / token_ids to each choice
    user: str | None = None  # accepted, unused
    # Structured output (compiled and validated; generation does not apply it yet).
    response_format: ResponseFormat | None = None  # OpenAI: text, json_object, json_schema
    structured_outputs: StructuredOutputs | None = None  # vLLM: json, regex, choice, grammar

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v):
        items = [v] if isinstance(v, str) else (v or [])
        if any(s == "" for s in items):
            raise ValueError("stop strings must not be empty")
        return v


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]  # text(s) or token id list(s)
    echo: bool = False  # prepend the prompt to the output (with its logprobs)
    logprobs: int | None = Field(default=None, ge=0, le=INT32_MAX)  # top logprobs per token
    suffix: str | None = None  # unsupported unless None
    best_of: int | None = None  # unsupported unless None or n
    logit_bias: dict[str, float] | None = None  # unsupported unless empty
    max_tokens: int | None = Field(default=16, ge=1, le=INT32_MAX)  # OpenAI's default

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt_shape(cls, v):
        return check_prompt_shape(v, MAX_PROMPTS, MAX_PROMPT_IDS)


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
    top_logprobs: int | None = Field(default=None, ge=0, le=INT32_MAX)  # alternatives per token
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)  # max_tokens
    add_generation_prompt: bool = True  # end the prompt with the assistant's turn
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables
    logit_bias: dict[str, float] | None = None  # unsupported unless empty
    tools: list[ChatTool] | None = None  # functions the model may call (and the template shows)
    tool_choice: ToolChoice | None = None  # none | auto | required | a named function
    parallel_tool_calls: bool | None = None  # several calls in one answer (default: allowed)

    @field_validator("tools", mode="before")
    @classmethod
    def _check_tools_shape(cls, v):
        # Counted on the raw JSON: pydantic would build a typed model (or an error) per item
        # first; --max-tools applies after.
        if isinstance(v, list) and len(v) > MAX_TOOLS:
            raise ValueError(f"at most {MAX_TOOLS} tools")
        return v


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
