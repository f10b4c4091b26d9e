"""A generation request as the engine tracks it across executors, and its client deltas."""

from __future__ import annotations

import asyncio
import time
from dataclasses import InitVar, dataclass, field
from typing import TYPE_CHECKING, Protocol

from common.wire.request_ids import request_id_of
from controller.core.outputs import GenerationRequest, OutputDelta, absorb, own_copy
from controller.core.request import Request
from controller.core.scheduler import RequestUpdate
from controller.observe.metrics import EngineMetrics, ExecutorSeries, RequestStats
from controller.text.detokenizer import OutputTextState

if TYPE_CHECKING:
    from common.wire.step_types import TokenLogprobs
    from controller.text.tokenizer import Tokenizer


class DeltaSink(Protocol):
    """Where a request's deltas go as the step loop makes them: an asyncio.Queue
    (`Engine.generate`), or a response's own channel (controller/api/deltas.py), which the
    step loop fills for every stream of a step before the response's writer wakes once."""

    def put_nowait(self, item: OutputDelta | Exception) -> None:
        """Take a delta, or the exception that ends the request (NoExecutorError)."""


class TokenSink(DeltaSink, Protocol):
    """A sink that takes each step's raw token ids (`takes_tokens` true): a stream writer
    process detokenizes and formats them (controller/api/writers/), so the step loop builds
    neither text nor a delta. Failures still come as `put_nowait` (an error delta or an
    exception)."""

    takes_tokens: bool  # True: the step loop calls `put_tokens`

    def put_tokens(
        self,
        token_ids: list[int],
        finish_reason: str | None,
        num_cached_tokens: int,
        logprobs: list[TokenLogprobs] | None,
    ) -> None:
        """A step's new token ids, the finish reason when the request ended there, its prompt
        tokens served from the prefix cache (for the usage chunk) and its tokens' logprobs
        (None unless it asked for them)."""


@dataclass(eq=False)
class Tracked:
    """Engine-side state of one generation request, wherever it runs."""

    gen: GenerationRequest  # what the API asked for
    queue: DeltaSink  # OutputDelta items (or an exception) for the API handler
    text: OutputTextState | None  # incremental detokenizer + stop strings (None: tokens_only)
    request: Request | None  # the scheduler's request (a new one on every placement)
    arrival: InitVar[float]  # perf_counter at arrival (kept in `stats`)
    arrival_time: float = field(default_factory=time.monotonic)  # kept across moves (FCFS)
    prompt_logprobs_sent: int = 0  # prompt positions already streamed
    prompt_logprobs_skip: int = 0  # positions a resumed request recomputes and must not resend
    placed_on: str | None = None  # address of the executor it is placed on; None: waiting
    placed_at: float = 0.0  # monotonic time of its latest placement
    queued_hashes: list[bytes] = field(default_factory=list)  # its blocks announced there
    expected_hit: int = 0  # tokens placement found cached for it there (admission reuses them)
    num_moves: int = 0  # times moved to another executor (failover or rebalance)
    num_failovers: int = 0  # times its executor was lost under it (bounded: max_request_moves)
    lost_at: float = 0.0  # perf_counter when its executor was lost; 0 once resumed
    waiting_since: float = 0.0  # monotonic time it started waiting for an executor
    hold_until: float = 0.0  # monotonic time before which it is not placed (failover settle)
    num_cached_tokens: int = 0  # prompt tokens served from a prefix cache where it started
    delivered: bool = False  # a delta went to the API handler already
    held: OutputDelta | None = None  # what a non-streamed request produced since its first
    # delta, not handed over yet (one delta, grown in place)
    quiet: bool = False  # delivered, and nothing but tokens can come before the end: steps
    # add tokens without building a delta (see `hold_quietly`)
    unsent_tokens: int = 0  # tokens no delta carried yet (the tail of the request's output)
    stats: RequestStats = field(init=False)  # its timings for the latency metrics
    tokens_only: bool = False  # its sink takes raw token ids (TokenSink): no text, no delta

    def note_cache_hit(self) -> None:
        """Keep the prompt's prefix-cache hit for usage: where the request started (a moved
        request reports its first placement's hit)."""
        req = self.request
        if self.num_moves == 0 and req is not None:
            self.num_cached_tokens = min(req.num_cached_tokens, req.num_prompt_tokens)

    def __post_init__(self, arrival: float) -> None:
        self.stats = RequestStats(arrival, len(self.gen.prompt_token_ids))

    @property
    def log_extra(self) -> dict[str, str]:
        """The ``extra`` of a log line about this request: its request id (the fleet logs from
        step loops and maintenance passes, away from the request's own task)."""
        return {"request_id": request_id_of(self.gen.request_id)}

    @property
    def output_token_ids(self) -> list[int]:
        """Tokens generated so far (across moves)."""
        return self.request.output_token_ids if self.request is not None else []


def track(gen: GenerationRequest, tokenizer: Tokenizer, sink: DeltaSink | None = None) -> Tracked:
    """A new request's state: its sink to the API handler (a new asyncio.Queue by default),
    its detokenizer, its arrival."""
    if getattr(sink, "takes_tokens", False):
        tracked = Tracked(gen=gen, queue=sink, text=None, request=None, arrival=time.perf_counter())
        tracked.tokens_only = True
        return tracked
    return Tracked(
        gen=gen,
        queue=sink if sink is not None else asyncio.Queue(),
        text=OutputTextState(
            tokenizer,
            gen.prompt_token_ids,
            stop=gen.stop,
            include_stop_str_in_output=gen.include_stop_str_in_output,
            skip_special_tokens=gen.skip_special_tokens,
            defer=not gen.stream,
        ),
        request=None,
        arrival=time.perf_counter(),
    )


def scheduler_request(
    gen: GenerationRequest, output_so_far: list[int], eos_token_ids: list[int], max_model_len: int
) -> Request:
    """The scheduler's Request for a generation request (resumed: with its output so far)."""
    req = Request(
        request_id=gen.request_id,
        prompt_token_ids=gen.prompt_token_ids,
        sampling=gen.sampling,
        max_tokens=gen.max_tokens,
        eos_token_ids=eos_token_ids,
        stop_token_ids=gen.stop_token_ids,
        ignore_eos=gen.ignore_eos,
        min_tokens=gen.min_tokens,
        priority=gen.priority,
        max_model_len=max_model_len,
    )
    if output_so_far:
        req.output_token_ids = list(output_so_far)
    if gen.grammar is not None:  # at the output's position: replayed after a move
        req.grammar = gen.grammar.replay(req.output_token_ids)
        if req.grammar.failed:
            raise ValueError(f"the output so far does not match its grammar: {req.grammar.error}")
    return req


def count_finished(
    metrics: EngineMetrics,
    reason: str | None,
    tracked: Tracked,
    now: float | None = None,
    series: ExecutorSeries | None = None,
) -> None:
    """Count a request's end in the metrics (on its executor's series; None: on none)."""
    req = tracked.request
    output = req.num_output_tokens if req is not None else None
    metrics.request_finished(reason, tracked.stats, output, now, series)


def hold_quietly(tracked: Tracked, update: RequestUpdate) -> bool:
    """Whether the update only adds tokens to a quiet request: then they stay in the request's
    output (counted in ``unsent_tokens``) until the delta that ends it carries them all. A
    non-streamed request with no stop string and no logprobs costs no delta per step."""
    if (
        tracked.quiet
        and not update.finished
        and update.logprobs is None
        and not update.prompt_logprobs
        and not update.error
    ):
        tracked.unsent_tokens += len(update.new_token_ids)
        return True
    return False


def make_delta(tracked: Tracked, update: RequestUpdate) -> OutputDelta:
    """The client's delta for one scheduler update: new text (a matched stop string ends the
    request with "stop"), token ids (with those held quietly before), logprobs, and the prompt
    logprobs not sent before a move.
    """
    assert tracked.request is not None
    finished, reason = update.finished, update.finish_reason
    new_token_ids = update.new_token_ids
    if tracked.unsent_tokens:
        new_token_ids = tracked.request.output_token_ids[
            -(tracked.unsent_tokens + len(new_token_ids)) :
        ]
        tracked.unsent_tokens = 0
    text, stopped = (
        tracked.text.update(new_token_ids, finished) if tracked.text is not None else ("", False)
    )
    if stopped and not finished:
        finished, reason = True, "stop"
    prompt_lps = update.prompt_logprobs or None
    if prompt_lps and tracked.prompt_logprobs_skip:
        skip = min(tracked.prompt_logprobs_skip, len(prompt_lps))
        prompt_lps = prompt_lps[skip:]
        tracked.prompt_logprobs_skip -= skip
    tracked.prompt_logprobs_sent += len(prompt_lps or ())
    req = tracked.request
    tracked.note_cache_hit()
    # Positional, in the field order: a keyword call costs several times more, per token.
    return OutputDelta(
        update.request_id,
        text,
        list(new_token_ids),
        update.logprobs,
        prompt_lps or None,
        finished,
        reason,
        req.num_prompt_tokens,
        req.num_output_tokens,
        tracked.num_cached_tokens,
        update.error or "",
    )


def error_delta(tracked: Tracked, error: str) -> OutputDelta:
    """The last delta of a request that failed alone (nothing new besides the error, kept
    encodable: it may quote what the client sent)."""
    req = tracked.request
    return OutputDelta(
        request_id=tracked.gen.request_id,
        finished=True,
        finish_reason="error",
        num_prompt_tokens=len(tracked.gen.prompt_token_ids),
        num_output_tokens=req.num_output_tokens if req is not None else 0,
        num_cached_tokens=tracked.num_cached_tokens,
        error=error.encode("utf-8", "backslashreplace").decode("utf-8"),
    )


def deliver(tracked: Tracked, delta: OutputDelta) -> None:
    """Hand a delta to the API handler. A streamed request gets every step's; a non-streamed
    one gets its first (which ends its queued time) and then one merged delta when it ends, so
    that its handler wakes twice instead of once per token."""
    held = tracked.held
    if tracked.gen.stream or not tracked.delivered or delta.finished:
        if held is not None:
            absorb(held, delta)
            delta, tracked.held = held, None
        if not tracked.delivered:
            gen = tracked.gen
            tracked.delivered = True
            tracked.quiet = (
                not gen.stream
                and gen.sampling.logprobs is None
                and tracked.text is not None
                and tracked.text.deferred
            )
        tracked.queue.put_nowait(delta)
    elif held is None:  # a copy whose lists this request alone grows
        tracked.held = own_copy(delta)
    else:
        absorb(held, delta)
