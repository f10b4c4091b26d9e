"""What a stream writer needs to know of one streamed response to format its chunks."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class StreamMeta:
    """One streamed response handed to a writer (sent as JSON in its OPEN message)."""

    response_id: str  # the chunks' "id"
    obj: str  # the chunks' "object": text_completion or chat.completion.chunk
    created: int  # the chunks' "created"
    model: str  # the chunks' "model"
    kind: str  # "completion" or "chat": which ChunkTemplate method builds a chunk
    sequences: list[int]  # the slots of its sequences, in choice-index order
    return_token_ids: bool = False  # each chunk carries its token ids
    include_usage: bool = False  # chunks carry "usage": null, and a usage chunk comes last
    prompt_tokens: int = 0  # the usage chunk's prompt_tokens
    skip_special_tokens: bool = True  # the detokenizer leaves special tokens out
    stop: list[str] = field(default_factory=list)  # stop strings the writer looks for
    include_stop_str_in_output: bool = False  # a matched stop string stays in the text
    prelude: list[str] = field(default_factory=list)  # SSE events written first (chat's role)
    logprobs: bool = False  # the chunks carry the tokens' logprobs (the STEPs bring them)
    echo: list[str] = field(default_factory=list)  # completions' echo: each sequence's prompt
    # text, prepended to its first chunk (empty: no echo)
    tool_parser: str = ""  # chat with tools: the tool-call format's name (controller.text.tools
    # FORMATS), its output read for calls as in process; "": plain text
    tool_max_calls: int | None = None  # the ToolPolicy's max_calls (1: no parallel calls)

    def to_json(self) -> dict[str, Any]:
        """The meta as the OPEN message carries it."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StreamMeta:
        """The meta of an OPEN message."""
        return cls(**data)
