"""One choice of a response, assembled from its request's deltas."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common.wire.step_types import TokenLogprobs

if TYPE_CHECKING:
    from controller.core.outputs import OutputDelta


@dataclass
class Choice:
    """One choice being assembled from deltas."""

    index: int  # position in the response's choices
    prompt_index: int  # which prompt it answers
    # The generated text in pieces, joined when read: `+=` on an attribute copies the whole
    # text so far, per token of a long stream.
    _pieces: list[str] = field(default_factory=list, repr=False)
    token_ids: list[int] = field(default_factory=list)  # generated tokens
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # per generated token
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # prompt positions 1..
    finish_reason: str | None = None  # set when finished
    error: str = ""  # set when the request failed
    num_cached_tokens: int = 0  # prefix-cache hit of its prompt
    # A delta was added (even one with no output: a chunked prefill's prompt logprobs): a
    # stream's first chunk, the one an echo puts the prompt in, is behind it.
    started: bool = False

    @property
    def text(self) -> str:
        """The generated text so far."""
        pieces = self._pieces
        if len(pieces) > 1:
            pieces[:] = ["".join(pieces)]
        return pieces[0] if pieces else ""

    def add(self, d: OutputDelta) -> None:
        """Append one delta of its request."""
        self.started = True
        if d.text:
            self._pieces.append(d.text)
        self.token_ids.extend(d.token_ids)
        if d.logprobs:
            self.logprobs.extend(d.logprobs)
        if d.prompt_logprobs:
            self.prompt_logprobs.extend(d.prompt_logprobs)
        self.num_cached_tokens = d.num_cached_tokens
        if d.finished:
            self.finish_reason = d.finish_reason
            self.error = d.error
