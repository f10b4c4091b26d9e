"""Domain types of one executor step, shared by the controller and the executors.

These mirror the messages of proto/executor.proto; `common.wire.convert` maps between the two so
that neither the scheduler nor the model runner touches protobuf. Pure Python: no torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Temperatures below this are greedy (as vLLM's): dividing logits by a tinier one overflows
# them to infinities, whose probabilities are NaN.
GREEDY_TEMPERATURE = 1e-5


def token_mask_bytes(vocab_size: int) -> int:
    """Bytes of an allowed-token mask (structured output) over a vocabulary. A mask is packed
    bits: little-endian uint32 words, bit t % 32 of word t // 32 set when token t may be
    sampled; ceil(vocab / 32) words."""
    return (vocab_size + 31) // 32 * 4


def allowed_bits(mask: bytes, vocab_size: int) -> int:
    """A packed mask as one integer whose bit t says whether token t is allowed (little-endian
    words of little-endian bits make the whole mask one little-endian number); the padding
    bits past the vocabulary are cleared."""
    return int.from_bytes(mask, "little") & ((1 << vocab_size) - 1)


@dataclass
class SamplingParams:
    """How to pick the next token of one request."""

    temperature: float = 0.0  # 0 (below GREEDY_TEMPERATURE) = greedy
    top_p: float = 1.0  # nucleus mass; 1 = off
    top_k: int = 0  # keep the k best tokens; 0 = off
    min_p: float = 0.0  # drop tokens below min_p * top probability; 0 = off
    seed: int | None = None  # per-request seed: same seed, same position -> same sample
    presence_penalty: float = 0.0  # OpenAI presence penalty over generated tokens
    frequency_penalty: float = 0.0  # OpenAI frequency penalty over generated tokens
    repetition_penalty: float = 1.0  # multiplicative, over prompt and generated tokens; 1 = off
    logprobs: int | None = None  # sampled token's logprob + this many top ones; None = none
    prompt_logprobs: int | None = None  # same for every prompt position; None = none
    min_tokens: int = 0  # stop_token_ids are not sampled before this many generated tokens
    stop_token_ids: list[int] = field(default_factory=list)  # ids that end the request

    @property
    def greedy(self) -> bool:
        """Argmax: a temperature of (nearly) 0."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


@dataclass
class NewRequestData:
    """A request the executor has not seen, or must recompute from scratch."""

    request_id: str  # unique within the controller session
    prompt_token_ids: list[int]  # the original prompt
    output_token_ids: list[int]  # tokens generated before a preemption / move; usually empty
    sampling: SamplingParams  # sampling parameters
    block_ids: list[int]  # KV blocks holding the request's tokens, in order
    num_computed_tokens: int  # tokens already in the cache (prefix hit); compute starts here
    num_scheduled_tokens: int  # tokens to compute in this step
    # Structured output: the tokens this step may sample, as packed bits (token_mask_bytes
    # says how); None = any token.
    allowed_token_mask: bytes | None = None


@dataclass
class CachedRequestData:
    """A request the executor already holds, scheduled again."""

    request_id: str  # id given when the request was new
    new_block_ids: list[int]  # blocks appended to its block table since its last step
    num_computed_tokens: int  # tokens in the cache before this step
    num_scheduled_tokens: int  # tokens to compute in this step
    allowed_token_mask: bytes | None = None  # as NewRequestData's; None = any token


@dataclass
class StepInput:
    """One scheduler step: a diff against the state the executor holds."""

    step_id: int  # increases by one per step on a session
    new_requests: list[NewRequestData] = field(default_factory=list)  # first-time requests
    cached_requests: list[CachedRequestData] = field(default_factory=list)  # known requests
    finished_request_ids: list[str] = field(default_factory=list)  # drop these requests' state

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(r.num_scheduled_tokens for r in self.new_requests) + sum(
            r.num_scheduled_tokens for r in self.cached_requests
        )

    @property
    def num_requests(self) -> int:
        return len(self.new_requests) + len(self.cached_requests)


@dataclass
class TokenLogprobs:
    """A token's logprob at one position and the best alternatives there."""

    token_id: int  # the sampled (or prompt) token
    logprob: float  # its log probability under the raw model distribution
    rank: int  # its 1-based rank in that distribution
    top_token_ids: list[int] = field(default_factory=list)  # best tokens, best first
    top_logprobs: list[float] = field(default_factory=list)  # their log probabilities


@dataclass
class RequestStepOutput:
    """What one step produced for one scheduled request."""

    request_id: str  # the scheduled request
    sampled_token_id: int | None = None  # None while a chunked prefill is partial
    logprobs: TokenLogprobs | None = None  # for the sampled token, when asked for
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # prompt positions done now
    error: str = ""  # non-empty when this request failed alone on the device


@dataclass
class StepOutput:
    """The result of one step."""

    step_id: int  # the StepInput this answers
    outputs: list[RequestStepOutput] = field(default_factory=list)  # one per scheduled request
    # (with sampled_token_ids: only those with logprobs, prompt logprobs or an error)
    device_seconds: float = 0.0  # device time of the step
    # As received by the controller: every scheduled request's sampled token in the step's order
    # (new requests, then cached ones), -1 for none; None = all are in `outputs`.
    sampled_token_ids: list[int] | None = None
