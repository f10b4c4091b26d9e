"""Generation requests from a validated body: sampling parameters, per-prompt token limits, one
`GenerationRequest` per sequence. Everything here runs after request_limits.py has bounded the
body, so the work is linear in what the limits allow."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.wire.request_ids import sequence_id
from common.wire.step_types import SamplingParams
from controller.api.constraints import RequestGrammars
from controller.api.errors import APIError
from controller.api.formats import Prompt
from controller.api.protocol import _SamplingFields
from controller.core.outputs import GenerationRequest

# Temperatures below this are greedy, as in vLLM: dividing logits by a temperature of 1e-39
# (a float32 subnormal on the wire) overflows them to inf, and the sampler's probabilities to
# NaN, where the client asked for the most likely token.
MIN_TEMPERATURE = 1e-5
# Repetition penalties below this are raised to it: a positive logit is divided by the penalty,
# so a smaller one overflows float32 logits to inf (1e-10 keeps logits of 1e27 finite), and one
# below float32's smallest subnormal (e.g. 5e-324) reaches the executor as 0.0, which it
# refuses. Either way the client asked for the strongest penalty, which this is.
MIN_REPETITION_PENALTY = 1e-10
_INT64 = 1 << 64


def choice_seed(seed: int, choice: int) -> int:
    """The seed of choice `choice` of a request seeded with `seed`: seed + choice, wrapped into
    the int64 range (two's complement). Every seed the API accepts works with every n, the
    choices get distinct seeds, and a seed that fitted before gives the same samples; seed +
    n - 1 past 2**63 - 1 no longer overflows the protobuf int64 (which failed the whole step)."""
    return (seed + choice + (1 << 63)) % _INT64 - (1 << 63)


@dataclass
class BuildOptions:
    """What the handler decided about a request, besides its body."""

    max_tokens: int | None  # the client's max_tokens (None: up to the context)
    logprobs: int | None  # top logprobs per output token (None: none)
    prompt_logprobs: int | None  # top logprobs per prompt token (None: none)
    stop: list[str]  # stop strings, bounded
    stop_token_ids: list[int]  # stop token ids, bounded and in the vocabulary
    base_id: str  # the request's unique id; sequence ids derive from it
    grammars: RequestGrammars = field(default_factory=RequestGrammars)  # compiled constraints


def sampling_params(
    req: _SamplingFields, opts: BuildOptions, choice: int, vocab_size: int
) -> SamplingParams:
    """The executor's sampling parameters for one choice."""
    temperature = 1.0 if req.temperature is None else req.temperature
    top_k = max(0, req.top_k or 0)
    return SamplingParams(
        temperature=0.0 if temperature < MIN_TEMPERATURE else temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if top_k >= vocab_size else top_k,  # all tokens: off
        min_p=req.min_p or 0.0,
        seed=None if req.seed is None else choice_seed(req.seed, choice),
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=(
            1.0
            if req.repetition_penalty is None
            else max(req.repetition_penalty, MIN_REPETITION_PENALTY)
        ),
        logprobs=opts.logprobs,
        prompt_logprobs=opts.prompt_logprobs,
    )


def token_limit(requested: int | None, prompt_len: int, capacity: int, param: str) -> int:
    """The most tokens one prompt may generate: `requested`, or what the context leaves; 400
    when the prompt is empty or prompt + requested does not fit `capacity`."""
    if prompt_len == 0:
        raise APIError("The prompt is empty.", 400, "prompt")
    if requested is None:
        requested = capacity - prompt_len
        if requested < 1:
            raise APIError(
                f"This model's maximum context length is {capacity} tokens. However, your "
                f"prompt has {prompt_len} tokens.",
                400,
                param,
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


def generation_requests(
    req: _SamplingFields,
    prompts: list[Prompt],
    limits: list[int],
    opts: BuildOptions,
    eos_token_ids: list[int],
    vocab_size: int,
) -> list[GenerationRequest]:
    """The sequences of a request, prompt after prompt (`limits`: each prompt's token limit)."""
    gens = []
    # Ids that end a request; the executor never samples them before min_tokens.
    ending = opts.stop_token_ids + ([] if req.ignore_eos else list(eos_token_ids))
    for p_index, (prompt, limit) in enumerate(zip(prompts, limits, strict=True)):
        for j in range(req.n):
            sampling = sampling_params(req, opts, j, vocab_size)
            # A grammar decides where a constrained output ends: min_tokens would mask the EOS
            # that a complete output needs, leaving no token to sample.
            constrained = opts.grammars.output is not None
            min_tokens = 0 if constrained else min(req.min_tokens, limit)
            if min_tokens:
                sampling.min_tokens, sampling.stop_token_ids = min_tokens, ending
            gens.append(
                GenerationRequest(
                    request_id=sequence_id(opts.base_id, p_index, j),
                    prompt_token_ids=prompt.token_ids,
                    sampling=sampling,
                    max_tokens=limit,
                    min_tokens=min_tokens,
                    stop=opts.stop,
                    stop_token_ids=opts.stop_token_ids,
                    ignore_eos=req.ignore_eos,
                    include_stop_str_in_output=req.include_stop_str_in_output,
                    skip_special_tokens=req.skip_special_tokens,
                    priority=req.priority,
                    stream=bool(req.stream),
                    grammar=opts.grammars.output,
                )
            )
    return gens
