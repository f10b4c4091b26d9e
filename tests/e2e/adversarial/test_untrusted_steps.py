"""Executors trust nothing: hand-crafted bad steps sent to real executor processes over gRPC,
as a buggy or hostile peer could. Each bad request is rejected alone (its error in the
result), the good requests of the same step are answered, the stream stays open and the
executor keeps serving. Before: out-of-range blocks failed the whole step ("slot out of range",
good requests included) or, on CUDA, an illegal memory access; the null block, duplicate ids,
oversized steps and insane sampling were run as sent."""

from __future__ import annotations

import math
import queue
import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.wire.pb import executor_pb2 as pb
from common.wire.pb import executor_pb2_grpc as pb_grpc
from tests.support.processes import spawn_executor, wait_until
from tests.support.token_masks import pack_mask

NUM_BLOCKS, MAX_TOKENS, MAX_SEQS, VOCAB = 16, 64, 4, 49152


class _Stream:
    """One ExecuteModel stream, a step at a time."""

    def __init__(self, stub: pb_grpc.ExecutorStub):
        self._requests: queue.Queue = queue.Queue()
        self._responses = stub.ExecuteModel(iter(self._requests.get, None), timeout=120)
        self._step = 0

    def step(self, new=(), cached=(), finished=()) -> pb.StepResult:
        self._step += 1
        self._requests.put(
            pb.StepRequest(
                step_id=self._step,
                new_requests=list(new),
                cached_requests=list(cached),
                finished_request_ids=list(finished),
            )
        )
        return next(self._responses)

    def close(self) -> None:
        self._requests.put(None)
        self._responses.cancel()


@pytest.fixture(scope="module", params=["executor_sim", "executor_gpu"])
def executor(request, default_model_dir, tmp_path_factory):
    """A real executor process (simulated, and the torch one on the CPU), handshaken with
    small limits; yields (stub, health stub)."""
    tmp = str(tmp_path_factory.mktemp(request.param))
    proc, port = spawn_executor(request.param, default_model_dir, tmp, "executor")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    health = health_pb2_grpc.HealthStub(channel)
    wait_until(lambda: _serving(health), 300, request.param, logs=tmp)
    stub = pb_grpc.ExecutorStub(channel)
    stub.InitDevice(
        pb.InitDeviceRequest(
            max_num_batched_tokens=MAX_TOKENS, max_num_seqs=MAX_SEQS, max_model_len=256
        ),
        timeout=120,
    )
    stub.InitializeCache(pb.InitializeCacheRequest(num_blocks=NUM_BLOCKS), timeout=300)
    stream = _Stream(stub)
    yield stream, health
    stream.close()
    channel.close()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert proc.returncode == 0


def _serving(health) -> bool:
    status = health.Check(health_pb2.HealthCheckRequest(), timeout=2).status
    return status == health_pb2.HealthCheckResponse.SERVING


def new(rid: str, prompt=(1, 2, 3, 4), blocks=(1,), scheduled=None, **sampling) -> pb.NewRequest:
    prompt = list(prompt)
    params = {"repetition_penalty": 1.0, "top_p": 1.0, **sampling}
    return pb.NewRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        block_ids=list(blocks),
        num_computed_tokens=0,
        num_scheduled_tokens=len(prompt) if scheduled is None else scheduled,
        sampling=pb.SamplingParams(**params),
    )


def _answers(result: pb.StepResult, step_ids: list[str]) -> dict[str, tuple[int, str]]:
    """Request id -> (sampled token or -1, error), from the packed result."""
    errors = {o.request_id: o.error for o in result.outputs}
    return {
        rid: (token, errors.get(rid, "")) for rid, token in zip(step_ids, result.sampled_token_ids)
    }


def _masked(request, allowed=(), raw: bytes | None = None):
    """``request`` constrained to the ``allowed`` tokens (or the ``raw`` mask bytes)."""
    request.allowed_token_mask = pack_mask(allowed, VOCAB) if raw is None else raw
    return request


BAD_NEW = {
    "block past the cache": (lambda: new("bad", blocks=(NUM_BLOCKS,)), "block id is outside"),
    "negative block": (lambda: new("bad", blocks=(-1,)), "block id is outside"),
    "the null block": (lambda: new("bad", blocks=(0,)), "block id is outside"),
    "token past the vocabulary": (lambda: new("bad", prompt=(1, VOCAB)), "token id outside"),
    "negative token": (lambda: new("bad", prompt=(-3, 1)), "token id outside"),
    "schedule past the known tokens": (lambda: new("bad", scheduled=9), "only 4 are known"),
    "too few blocks": (lambda: new("bad", prompt=[5] * 20, blocks=(1,)), "KV blocks, has 1"),
    "step past its token limit": (lambda: new("bad", [5] * 70, range(1, 6)), "more than 64"),
    "NaN temperature": (lambda: new("bad", temperature=math.nan), "temperature"),
    "negative top_k": (lambda: new("bad", top_k=-9), "top_k"),
    "zero repetition penalty": (lambda: new("bad", repetition_penalty=0.0), "repetition"),
    "logprobs past the maximum": (lambda: new("bad", logprobs=10**6), "logprobs"),
    "stop id past the vocabulary": (
        lambda: new("bad", min_tokens=2, stop_token_ids=[VOCAB]),
        "stop token id",
    ),
    "mask of the wrong length": (
        lambda: _masked(new("bad"), raw=bytes(VOCAB // 8 - 1)),
        "holds 6143 bytes, not 6144",
    ),
    "mask allowing no token": (lambda: _masked(new("bad"), raw=bytes(VOCAB // 8)), "allows no"),
}


@pytest.mark.parametrize("case", list(BAD_NEW))
def test_a_bad_new_request_is_rejected_alone(executor, case):
    stream, health = executor
    make, why = BAD_NEW[case]
    ids = ["good-a", "bad", "good-b"]
    result = stream.step(new=[new("good-a", blocks=(2,)), make(), new("good-b", blocks=(3,))])
    answers = _answers(result, ids)
    assert why in answers["bad"][1] and answers["bad"][0] == -1
    for rid in ("good-a", "good-b"):
        token, error = answers[rid]
        assert not error and 0 <= token < VOCAB
    stream.step(finished=ids)  # the bad one is unknown by now: ignored
    assert _serving(health)


def test_step_wide_faults_reject_only_the_requests_at_fault(executor):
    stream, health = executor
    result = stream.step(new=[new("held", blocks=(1,))])
    assert _answers(result, ["held"])["held"][1] == ""
    # An id twice, a new id already held, an unknown cached id, a good request.
    ids = ["twice", "twice", "held", "good", "ghost"]
    result = stream.step(
        new=[
            new("twice", blocks=(2,)),
            new("twice", blocks=(3,)),
            new("held", blocks=(4,)),
            new("good", blocks=(5,)),
        ],
        cached=[
            pb.CachedRequest(request_id="ghost", num_computed_tokens=4, num_scheduled_tokens=1)
        ],
    )
    answers = _answers(result, ids)
    assert "scheduled 2 times" in answers["twice"][1]
    assert "already held" in answers["held"][1]
    assert "unknown request" in answers["ghost"][1]
    assert answers["good"][1] == "" and 0 <= answers["good"][0] < VOCAB
    stream.step(finished=ids)
    # More requests than max_num_seqs: the ones past it are rejected, the rest run.
    many = [new(f"r{i}", blocks=(6 + i,)) for i in range(MAX_SEQS + 2)]
    answers = _answers(stream.step(new=many), [r.request_id for r in many])
    assert [a[1] == "" for a in answers.values()] == [True] * MAX_SEQS + [False] * 2
    assert all("more than 4 requests" in a[1] for a in list(answers.values())[MAX_SEQS:])
    stream.step(finished=[r.request_id for r in many])
    assert _serving(health)


def test_masked_requests_sample_allowed_tokens_and_a_bad_mask_fails_alone(executor):
    """Structured output: each masked request samples an allowed token, an unmasked one in the
    same step is unaffected; a later bad mask fails its request alone."""
    stream, health = executor
    ids = ["m", "one", "free"]
    result = stream.step(
        new=[
            _masked(new("m", blocks=(2,)), (500, 1234, VOCAB - 1)),
            _masked(new("one", blocks=(3,), temperature=1.0, top_k=5, logprobs=3), (77,)),
            new("free", blocks=(4,)),
        ]
    )
    answers = _answers(result, ids)
    assert answers["m"] == (answers["m"][0], "") and answers["m"][0] in (500, 1234, VOCAB - 1)
    assert answers["one"] == (77, "") and answers["free"][1] == ""
    lps = {o.request_id: o.logprobs for o in result.outputs if o.HasField("logprobs")}
    assert list(lps["one"].top_token_ids) == [77]  # the constrained distribution: 1 token
    cached = [
        pb.CachedRequest(
            request_id="m",
            num_computed_tokens=4,
            num_scheduled_tokens=1,
            allowed_token_mask=bytes(8),
        ),
        pb.CachedRequest(
            request_id="one",
            num_computed_tokens=4,
            num_scheduled_tokens=1,
            allowed_token_mask=pack_mask([9], VOCAB),
        ),
        pb.CachedRequest(request_id="free", num_computed_tokens=4, num_scheduled_tokens=1),
    ]
    answers = _answers(stream.step(cached=cached), ids)
    assert "holds 8 bytes" in answers["m"][1] and answers["m"][0] == -1
    assert answers["one"] == (9, "") and answers["free"][1] == ""
    stream.step(finished=ids)
    assert _serving(health)


def test_the_executor_serves_a_whole_request_after_every_attack(executor):
    """A request decoded over several steps: the state the attacks left is sound."""
    stream, health = executor
    tokens = []
    answers = _answers(stream.step(new=[new("after", prompt=(1, 2, 3), blocks=(9,))]), ["after"])
    tokens.append(answers["after"][0])
    for computed in range(3, 8):
        cached = pb.CachedRequest(
            request_id="after", num_computed_tokens=computed, num_scheduled_tokens=1
        )
        token, error = _answers(stream.step(cached=[cached]), ["after"])["after"]
        assert not error
        tokens.append(token)
    assert all(0 <= t < VOCAB for t in tokens)
    stream.step(finished=["after"])
    assert _serving(health)
