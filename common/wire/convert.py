"""Mapping between the wire messages (common.wire.pb) and the domain types (common.wire.step_types).

Both sides of the gRPC boundary use it: the executor's servicer decodes steps and encodes
results, the controller's session does the reverse. Pure Python plus protobuf; no torch.
"""

from __future__ import annotations

from common.wire.config import (
    Capabilities,
    DeviceInfo,
    KVCacheSpec,
    MemoryProfile,
    ModelGeometry,
)
from common.wire.pb import executor_pb2 as pb
from common.wire.step_types import (
    CachedRequestData,
    NewRequestData,
    RequestStepOutput,
    SamplingParams,
    StepInput,
    StepOutput,
    TokenLogprobs,
)

# --- sampling -------------------------------------------------------------------------------


def sampling_to_pb(s: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty,
        min_tokens=s.min_tokens,
        stop_token_ids=s.stop_token_ids,
    )
    if s.seed is not None:
        msg.seed = s.seed
    if s.logprobs is not None:
        msg.logprobs = s.logprobs
    if s.prompt_logprobs is not None:
        msg.prompt_logprobs = s.prompt_logprobs
    return msg


def sampling_from_pb(m: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=m.temperature,
        top_p=m.top_p,
        top_k=m.top_k,
        min_p=m.min_p,
        seed=m.seed if m.HasField("seed") else None,
        presence_penalty=m.presence_penalty,
        frequency_penalty=m.frequency_penalty,
        repetition_penalty=m.repetition_penalty,
        logprobs=m.logprobs if m.HasField("logprobs") else None,
        prompt_logprobs=m.prompt_logprobs if m.HasField("prompt_logprobs") else None,
        min_tokens=m.min_tokens,
        stop_token_ids=list(m.stop_token_ids),
    )


# --- steps ----------------------------------------------------------------------------------


def step_to_pb(step: StepInput, packed: bool = True) -> pb.StepRequest:
    # Messages are added in place (``add``), repeated fields set only when non-empty: 2-3x
    # faster than building each message and handing the list over (a step is rebuilt for every
    # running request, every step). `packed`: the executor reads the packed_* arrays
    # (Capabilities.packed_steps).
    msg = pb.StepRequest(step_id=step.step_id, finished_request_ids=step.finished_request_ids)
    add_new = msg.new_requests.add
    for r in step.new_requests:
        new = add_new(
            request_id=r.request_id,
            prompt_token_ids=r.prompt_token_ids,
            output_token_ids=r.output_token_ids,
            sampling=sampling_to_pb(r.sampling),
            block_ids=r.block_ids,
            num_computed_tokens=r.num_computed_tokens,
            num_scheduled_tokens=r.num_scheduled_tokens,
        )
        if r.allowed_token_mask is not None:
            new.allowed_token_mask = r.allowed_token_mask
    cached_requests = step.cached_requests
    if not cached_requests:
        return msg
    if packed and all(r.allowed_token_mask is None for r in cached_requests):
        _pack_cached(msg, cached_requests)
        return msg
    add_cached = msg.cached_requests.add
    for r in cached_requests:
        cached = add_cached(
            request_id=r.request_id,
            num_computed_tokens=r.num_computed_tokens,
            num_scheduled_tokens=r.num_scheduled_tokens,
        )
        if r.new_block_ids:
            cached.new_block_ids.extend(r.new_block_ids)
        if r.allowed_token_mask is not None:
            cached.allowed_token_mask = r.allowed_token_mask
    return msg


def _pack_cached(msg: pb.StepRequest, cached: list[CachedRequestData]) -> None:
    """The cached requests as the StepRequest's packed_* arrays (every decode step: one
    array per field instead of a message per request)."""
    msg.packed_request_ids.extend([r.request_id for r in cached])
    msg.packed_num_computed_tokens.extend([r.num_computed_tokens for r in cached])
    msg.packed_num_scheduled_tokens.extend([r.num_scheduled_tokens for r in cached])
    counts = [len(r.new_block_ids) for r in cached]
    if any(counts):
        msg.packed_num_new_blocks.extend(counts)
        blocks = msg.packed_new_block_ids
        for r in cached:
            if r.new_block_ids:
                blocks.extend(r.new_block_ids)


def _unpack_cached(m: pb.StepRequest) -> list[CachedRequestData]:
    """The packed cached requests of a StepRequest. Never raises on inconsistent arrays (the
    sender may be anyone): a missing count is -1 and fails that request alone at the step
    check (a bad schedule), and a request whose blocks are missing gets those there are."""
    ids = m.packed_request_ids
    n = len(ids)
    computed = list(m.packed_num_computed_tokens[:n])
    computed += [-1] * (n - len(computed))
    scheduled = list(m.packed_num_scheduled_tokens[:n])
    scheduled += [-1] * (n - len(scheduled))
    counts = list(m.packed_num_new_blocks[:n])
    if not any(counts):
        return [CachedRequestData(*row) for row in zip(ids, [[] for _ in ids], computed, scheduled)]
    counts += [0] * (n - len(counts))
    blocks = list(m.packed_new_block_ids)
    out = []
    at = 0
    for rid, count, comp, sched in zip(ids, counts, computed, scheduled):
        take = max(count, 0)
        out.append(CachedRequestData(rid, blocks[at : at + take], comp, sched))
        at += take
    return out


def _wire_error(exc: Exception) -> str:
    """An encodable description of a conversion error (its text may quote the bad value:
    a lone surrogate would break whatever encodes the message next)."""
    return f"{type(exc).__name__}: {exc}".encode("ascii", "backslashreplace").decode()[:300]


#: What protobuf raises for a value its field cannot carry (UnicodeError is a ValueError).
CONVERSION_ERRORS = (ValueError, TypeError, OverflowError)


def _wire_problem(step: StepInput) -> str:
    """Why ``step`` (one request) cannot be put in a StepRequest ("" when it can): the same
    conversion ``step_to_pb`` makes, so the check cannot drift from what is sent."""
    try:
        step_to_pb(step)
    except CONVERSION_ERRORS as exc:
        return f"the request cannot be sent to an executor ({_wire_error(exc)})"
    return ""


def new_request_wire_problem(r: NewRequestData) -> str:
    """Why a new request cannot be put in a StepRequest ("" when it can): a value its field
    cannot carry (a seed outside int64, a token id outside int32, a string that is not UTF-8)."""
    return _wire_problem(StepInput(0, new_requests=[r]))


def step_wire_problems(step: StepInput) -> dict[str, str]:
    """The requests of a step that cannot be put in a StepRequest, by id, with why (the step
    converts once they are left out; ``step_to_pb`` raised for it)."""
    singles = [(r.request_id, StepInput(0, new_requests=[r])) for r in step.new_requests]
    singles += [(c.request_id, StepInput(0, cached_requests=[c])) for c in step.cached_requests]
    problems = {}
    for rid, single in singles:
        problem = _wire_problem(single)
        if problem:
            problems[rid] = problem
    return problems


def step_from_pb(m: pb.StepRequest) -> StepInput:
    return StepInput(
        step_id=m.step_id,
        new_requests=[
            NewRequestData(
                request_id=r.request_id,
                prompt_token_ids=list(r.prompt_token_ids),
                output_token_ids=list(r.output_token_ids),
                sampling=sampling_from_pb(r.sampling),
                block_ids=list(r.block_ids),
                num_computed_tokens=r.num_computed_tokens,
                num_scheduled_tokens=r.num_scheduled_tokens,
                allowed_token_mask=r.allowed_token_mask or None,
            )
            for r in m.new_requests
        ],
        cached_requests=[
            CachedRequestData(
                request_id=r.request_id,
                new_block_ids=list(r.new_block_ids),
                num_computed_tokens=r.num_computed_tokens,
                num_scheduled_tokens=r.num_scheduled_tokens,
                allowed_token_mask=r.allowed_token_mask or None,
            )
            for r in m.cached_requests
        ]
        + (_unpack_cached(m) if m.packed_request_ids else []),
        finished_request_ids=list(m.finished_request_ids),
    )


def _logprobs_to_pb(lp: TokenLogprobs) -> pb.TokenLogprobs:
    return pb.TokenLogprobs(
        token_id=lp.token_id,
        logprob=lp.logprob,
        rank=lp.rank,
        top_token_ids=lp.top_token_ids,
        top_logprobs=lp.top_logprobs,
    )


def _logprobs_from_pb(m: pb.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(
        token_id=m.token_id,
        logprob=m.logprob,
        rank=m.rank,
        top_token_ids=list(m.top_token_ids),
        top_logprobs=list(m.top_logprobs),
    )


def _output_to_pb(o: RequestStepOutput) -> pb.RequestOutput:
    msg = pb.RequestOutput(request_id=o.request_id, error=o.error)
    if o.sampled_token_id is not None:
        msg.sampled_token_id = o.sampled_token_id
    if o.logprobs is not None:
        msg.logprobs.CopyFrom(_logprobs_to_pb(o.logprobs))
    if o.prompt_logprobs:
        msg.prompt_logprobs.extend(_logprobs_to_pb(p) for p in o.prompt_logprobs)
    return msg


def result_to_pb(out: StepOutput, step: StepInput | None = None) -> pb.StepResult:
    """The result message; given the step it answers, in the packed form: every request's
    token in `sampled_token_ids`, a message only for requests with more to report."""
    msg = pb.StepResult(step_id=out.step_id, device_seconds=out.device_seconds)
    if step is None or not out.outputs:
        msg.outputs.extend(_output_to_pb(o) for o in out.outputs)
        return msg
    sampled = {}
    for o in out.outputs:
        sampled[o.request_id] = -1 if o.sampled_token_id is None else o.sampled_token_id
        if o.logprobs is not None or o.prompt_logprobs or o.error:
            msg.outputs.append(_output_to_pb(o))
    get = sampled.get
    msg.sampled_token_ids.extend([get(r.request_id, -1) for r in step.new_requests])
    msg.sampled_token_ids.extend([get(r.request_id, -1) for r in step.cached_requests])
    return msg


def result_from_pb(m: pb.StepResult) -> StepOutput:
    outputs = []
    append = outputs.append
    for o in m.outputs:
        has = o.HasField
        lps = o.prompt_logprobs
        append(
            RequestStepOutput(
                request_id=o.request_id,
                sampled_token_id=o.sampled_token_id if has("sampled_token_id") else None,
                logprobs=_logprobs_from_pb(o.logprobs) if has("logprobs") else None,
                prompt_logprobs=[_logprobs_from_pb(p) for p in lps] if lps else [],
                error=o.error,
            )
        )
    return StepOutput(
        step_id=m.step_id,
        outputs=outputs,
        device_seconds=m.device_seconds,
        sampled_token_ids=list(m.sampled_token_ids) or None,
    )


# --- handshake ------------------------------------------------------------------------------


def device_info_to_pb(d: DeviceInfo) -> pb.InitDeviceResponse:
    g, kv, c = d.model, d.kv_cache, d.capabilities
    return pb.InitDeviceResponse(
        incarnation_id=d.incarnation_id,
        device_kind=d.device_kind,
        device_name=d.device_name,
        model=pb.ModelGeometry(
            model_name=g.model_name,
            architecture=g.architecture,
            vocab_size=g.vocab_size,
            num_layers=g.num_layers,
            num_kv_heads=g.num_kv_heads,
            head_dim=g.head_dim,
            max_model_len=g.max_model_len,
            eos_token_ids=g.eos_token_ids,
            layer_windows=g.layer_windows,
        ),
        kv_cache=pb.KVCacheSpec(
            block_size=kv.block_size, bytes_per_block=kv.bytes_per_block, dtype=kv.dtype
        ),
        capabilities=pb.Capabilities(
            chunked_prefill=c.chunked_prefill,
            max_tokens_per_step=c.max_tokens_per_step,
            token_buckets=c.token_buckets,
            request_buckets=c.request_buckets,
            max_num_seqs=c.max_num_seqs,
            max_logprobs=c.max_logprobs,
            tensor_parallel_size=c.tensor_parallel_size,
            packed_steps=c.packed_steps,
            step_socket_port=c.step_socket_port,
        ),
    )


def device_info_from_pb(m: pb.InitDeviceResponse) -> DeviceInfo:
    g, kv, c = m.model, m.kv_cache, m.capabilities
    return DeviceInfo(
        incarnation_id=m.incarnation_id,
        device_kind=m.device_kind,
        device_name=m.device_name,
        model=ModelGeometry(
            model_name=g.model_name,
            architecture=g.architecture,
            vocab_size=g.vocab_size,
            num_layers=g.num_layers,
            num_kv_heads=g.num_kv_heads,
            head_dim=g.head_dim,
            max_model_len=g.max_model_len,
            eos_token_ids=list(g.eos_token_ids),
            layer_windows=list(g.layer_windows),
        ),
        kv_cache=KVCacheSpec(
            block_size=kv.block_size, bytes_per_block=kv.bytes_per_block, dtype=kv.dtype
        ),
        capabilities=Capabilities(
            chunked_prefill=c.chunked_prefill,
            max_tokens_per_step=c.max_tokens_per_step,
            token_buckets=list(c.token_buckets),
            request_buckets=list(c.request_buckets),
            max_num_seqs=c.max_num_seqs,
            max_logprobs=c.max_logprobs,
            tensor_parallel_size=max(1, c.tensor_parallel_size),
            packed_steps=c.packed_steps,
            step_socket_port=c.step_socket_port,
        ),
    )


def memory_profile_to_pb(p: MemoryProfile) -> pb.ProfileMemoryResponse:
    return pb.ProfileMemoryResponse(
        available_kv_bytes=p.available_kv_bytes,
        weights_bytes=p.weights_bytes,
        peak_activation_bytes=p.peak_activation_bytes,
    )


def memory_profile_from_pb(m: pb.ProfileMemoryResponse) -> MemoryProfile:
    return MemoryProfile(
        available_kv_bytes=m.available_kv_bytes,
        weights_bytes=m.weights_bytes,
        peak_activation_bytes=m.peak_activation_bytes,
    )
