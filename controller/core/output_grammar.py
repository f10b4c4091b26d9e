"""A request's output grammar as the scheduler sees it: which tokens its next step may sample,
and what a sampled token does to it.

Structured output (JSON schemas, regexes, choices, tool calls) is enforced by the controller:
each step that samples a constrained request's token carries the request's allowed tokens
(packed bits, see common.wire.step_types.token_mask_bytes), the executor masks everything
else out before sampling, and the sampled token advances the grammar here when the result
comes back. The next mask depends on that token, so a constrained request is never scheduled
while a token of its is in flight: its steps are not pipelined (see
`SchedulerBase.needs_results_first`).

The grammar engine lives in controller.text.grammar; core sees only this protocol, so the
scheduler stays free of it (and testable with a fake).
"""

from __future__ import annotations

from typing import Protocol


class OutputGrammar(Protocol):
    """One request's position in its grammar (controller.text.grammar.GrammarMatcher)."""

    def allowed_mask(self) -> bytes:
        """The tokens allowed next, packed bits over the vocabulary."""
        ...

    def accept(self, token_id: int) -> bool:
        """Take a sampled token; False when the grammar refuses it."""
        ...

    def is_finished(self) -> bool:
        """Nothing may follow: the output is complete (or the grammar failed)."""
        ...

    @property
    def error(self) -> str:
        """Why the grammar failed ("" when it did not)."""
        ...


class Constrained(Protocol):
    """What these functions use of a request (controller.core.request.Request)."""

    grammar: OutputGrammar | None  # the output's grammar at the output's position
    grammar_mask: bytes | None  # its allowed next tokens, once computed


def next_mask(request: Constrained) -> bytes:
    """The allowed tokens of a constrained request's next sample (computed once per
    position: a request scheduled again after a preemption reuses it)."""
    mask = request.grammar_mask
    if mask is None:
        assert request.grammar is not None
        mask = request.grammar_mask = request.grammar.allowed_mask()
    return mask


def advance(request: Constrained, token_id: int) -> tuple[str | None, str]:
    """Feed a constrained request's sampled token to its grammar; (finish reason, error):
    "error" when the grammar refuses the token (an executor that did not apply the mask) or
    allows no token after it (a grammar that cannot be completed), "stop" when the output is
    complete, None to go on (the next mask is then computed, so a dead end shows now)."""
    grammar = request.grammar
    assert grammar is not None
    request.grammar_mask = None
    if not grammar.accept(token_id):
        reason = grammar.error or f"token {token_id} is not allowed here"
        return "error", f"the output no longer matches its grammar: {reason}"
    if grammar.is_finished():
        return "stop", ""
    mask = next_mask(request)
    if mask.count(0) == len(mask):
        reason = grammar.error or "no token can continue it"
        return "error", f"the output cannot be completed under its grammar: {reason}"
    return None, ""
