"""The executor's step socket (common/host/step_socket.py), against real executor processes
over real sockets: the advertised port; the same greedy tokens as the gRPC ExecuteModel stream;
gRPC's replacement, fencing, cancellation by a new owner and token semantics carried over
(END frames with the gRPC status names); and hostile input that costs the executor nothing:
wrong magic, oversized frame headers (its RSS does not grow), frames that do not parse, more
connections than the cap, silent or slow clients (closed by the hello timeout) and clients
that vanish mid-stream, after which gRPC and socket streams still work and health stays
SERVING."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass

import grpc
import pytest
from tokenizers import Tokenizer

from common.wire.pb import executor_pb2 as pb
from common.wire.pb import executor_pb2_grpc as pb_grpc
from common.wire.rpc_token import token_metadata
from common.wire.step_frames import HEADER, HELLO, MAGIC, RESULT, STEP, frame
from tests.support.processes import PeakRSS, free_port, grpc_health, spawn_executor, wait_until
from tests.support.step_streams import GrpcStepStream, SocketStepStream, StreamEnded

MAX_STEP_BYTES = 256 * 2**20  # the executor's bound on a step frame (common/host/server.py)
MAX_CONNECTIONS = 8  # StepSocketServer's default cap
DECODE_STEPS = 8  # tokens generated per request in the comparisons
RSS_SLACK_MIB = 8  # what a refused frame may cost the executor, at most
TOKEN = "s3cret-step-token"  # the token test's executor token


@dataclass
class _Executor:
    """A running executor process: its ports, gRPC channel and token ("": none)."""

    proc: subprocess.Popen
    port: int
    step_port: int  # 0: no --step-port
    channel: grpc.Channel
    token: str = ""
    info: pb.InitDeviceResponse | None = None  # the last InitDevice's answer

    @property
    def stub(self) -> pb_grpc.ExecutorStub:
        return pb_grpc.ExecutorStub(self.channel)

    @property
    def metadata(self) -> tuple | None:
        return token_metadata(self.token) or None

    def handshake(self) -> pb.InitDeviceResponse:
        """A new ownerless session: InitDevice, then InitializeCache (16 blocks)."""
        req = pb.InitDeviceRequest(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=256)
        self.info = self.stub.InitDevice(req, timeout=120, metadata=self.metadata)
        cache = pb.InitializeCacheRequest(num_blocks=16)
        self.stub.InitializeCache(cache, timeout=300, metadata=self.metadata)
        return self.info

    def stop(self) -> None:
        self.channel.close()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=30)


def _start(module: str, model: str, logs: str, step_port=0, extra=(), token="") -> _Executor:
    """Spawn an executor (with --step-port when given), wait until its health is SERVING."""
    extra = [*extra, "--step-port", str(step_port)] if step_port else list(extra)
    proc, port = spawn_executor(module, model, logs, module, extra=extra)
    wait_until(lambda: grpc_health(f"127.0.0.1:{port}") == "SERVING", 300, module, logs=logs)
    return _Executor(proc, port, step_port, grpc.insecure_channel(f"127.0.0.1:{port}"), token)


@pytest.fixture(scope="module")
def executor(default_model_dir, tmp_path_factory):
    """One executor_gpu with --step-port, handshaken over gRPC."""
    logs = str(tmp_path_factory.mktemp("step_socket"))
    ex = _start("executor_gpu", default_model_dir, logs, step_port=free_port())
    ex.handshake()
    yield ex
    ex.stop()


def _generate(run_step, rid: str, prompt: list[int], block_size: int) -> list[int]:
    """Greedy decoding of `prompt` for DECODE_STEPS steps through `run_step` (a stream's
    `step`): a NewRequest's prefill, then a CachedRequest per token; then the request is
    dropped (finished_request_ids). The sampled tokens."""
    blocks = list(range(1, -(-(len(prompt) + DECODE_STEPS) // block_size) + 1))
    sampling = pb.SamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=1.0)
    new = pb.NewRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling)
    new.block_ids.extend(blocks)
    new.num_scheduled_tokens = len(prompt)
    tokens = [_token(run_step(pb.StepRequest(new_requests=[new])), rid)]
    while len(tokens) < DECODE_STEPS:
        computed = len(prompt) + len(tokens) - 1
        cached = pb.CachedRequest(request_id=rid, num_computed_tokens=computed)
        cached.num_scheduled_tokens = 1
        tokens.append(_token(run_step(pb.StepRequest(cached_requests=[cached])), rid))
    run_step(pb.StepRequest(finished_request_ids=[rid]))
    return tokens


def _token(result: pb.StepResult, rid: str) -> int:
    """The token sampled for the step's one request (packed, or in its output)."""
    errors = [o.error for o in result.outputs if o.error]
    assert not errors, errors
    if result.sampled_token_ids:
        return result.sampled_token_ids[0]
    (out,) = [o for o in result.outputs if o.request_id == rid]
    return out.sampled_token_id


def _prompt(model_dir: str) -> list[int]:
    tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    return tokenizer.encode("The capital of France is Paris, and the capital of Italy is").ids


def _assert_serving(ex: _Executor) -> None:
    """Health SERVING, a gRPC step stream and then a socket step stream run a step each."""
    assert grpc_health(f"127.0.0.1:{ex.port}") == "SERVING"
    stream = GrpcStepStream(ex.stub, ex.metadata)
    assert stream.step().step_id == 1
    stream.close()
    sock = SocketStepStream(ex.step_port, token=ex.token)
    assert sock.step().step_id == 1
    assert sock.step().step_id == 2
    sock.close()


def _one_step(port: int) -> bool:
    """Whether a new socket stream runs a step (it is closed after)."""
    sock = SocketStepStream(port)
    try:
        return sock.step().step_id == 1
    finally:
        sock.close()


# --- tests ------------------------------------------------------------------------------


def test_advertised_port(executor, default_model_dir, tmp_path):
    assert executor.step_port
    assert executor.info.capabilities.step_socket_port == executor.step_port
    plain = _start("executor_sim", default_model_dir, str(tmp_path))  # no --step-port
    try:
        assert plain.handshake().capabilities.step_socket_port == 0
    finally:
        plain.stop()


def test_same_tokens_as_grpc(executor, default_model_dir):
    prompt = _prompt(default_model_dir)
    block_size = executor.info.kv_cache.block_size
    vocab = executor.info.model.vocab_size
    stream = GrpcStepStream(executor.stub, executor.metadata)
    over_grpc = _generate(stream.step, "grpc-same", prompt, block_size)
    stream.close()
    sock = SocketStepStream(executor.step_port, generation=executor.info.generation)
    over_socket = _generate(sock.step, "socket-same", prompt, block_size)
    sock.close()
    assert len(over_grpc) == DECODE_STEPS and all(0 <= t < vocab for t in over_grpc)
    assert over_socket == over_grpc


def test_a_newer_grpc_stream_replaces_a_socket_stream(executor):
    sock = SocketStepStream(executor.step_port)
    assert sock.step().step_id == 1
    stream = GrpcStepStream(executor.stub, executor.metadata)
    assert stream.step().step_id == 1
    with pytest.raises(StreamEnded) as ended:
        sock.step()
    assert ended.value.code == "ABORTED"
    assert "replaced by a newer step stream" in ended.value.details
    assert sock.closed(within=5)
    assert stream.step().step_id == 2  # the newer stream goes on
    stream.close()
    sock.close()


def test_a_newer_socket_stream_replaces_a_grpc_stream(executor):
    stream = GrpcStepStream(executor.stub, executor.metadata)
    assert stream.step().step_id == 1
    sock = SocketStepStream(executor.step_port)
    assert sock.step().step_id == 1
    with pytest.raises(grpc.RpcError) as exc:
        stream.step()
    assert exc.value.code() == grpc.StatusCode.ABORTED
    assert "replaced by a newer step stream" in exc.value.details()
    assert sock.step().step_id == 2
    sock.close()
    stream.close()


def test_fencing(executor):
    old = executor.info.generation
    sock = SocketStepStream(executor.step_port, generation=old)
    assert sock.step().step_id == 1
    new = executor.handshake().generation  # another controller's session
    assert new > old
    with pytest.raises(StreamEnded) as ended:  # same (no) owner: the open stream is replaced
        sock.step()
    assert ended.value.code == "ABORTED"
    assert "newer controller session" in ended.value.details
    sock.close()
    stale = SocketStepStream(executor.step_port, generation=old)  # a new stream of the old session
    end = stale.end()  # at once: no step needed
    assert end.code == "FAILED_PRECONDITION" and f"generation {old} is stale" in end.details
    stale.close()
    current = SocketStepStream(executor.step_port, generation=new)
    assert current.step().step_id == 1
    current.close()


def test_another_owner_ends_an_open_stream_at_once(executor):
    """A named owner taking the executor cancels the open stream without waiting for its next
    step: the controller reads END CANCELLED (not a reset) and the connection closes."""
    sock = SocketStepStream(executor.step_port, generation=executor.info.generation)
    assert sock.step().step_id == 1
    req = pb.InitDeviceRequest(
        max_num_batched_tokens=64, max_num_seqs=4, max_model_len=256, owner_id="ctl-b"
    )
    taken = executor.stub.InitDevice(req, timeout=120)
    try:
        end = sock.end()  # no step sent: the END comes unasked
        assert end.code == "CANCELLED", end
    finally:
        sock.close()
        lease = pb.LeaseRequest(owner_id="ctl-b", generation=taken.generation)
        executor.stub.ReleaseSession(lease, timeout=30)
    executor.handshake()  # ownerless again, for the tests after this one
    assert _one_step(executor.step_port)


def test_token(default_model_dir, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    extra = ["--auth-token-file", str(token_file)]
    ex = _start("executor_gpu", default_model_dir, str(tmp_path), free_port(), extra, TOKEN)
    try:
        with pytest.raises(grpc.RpcError) as exc:  # gRPC still needs its metadata
            ex.stub.InitDevice(pb.InitDeviceRequest(), timeout=30)
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        ex.handshake()
        missing = SocketStepStream(ex.step_port)
        assert missing.end().code == "UNAUTHENTICATED"
        missing.close()
        wrong = SocketStepStream(ex.step_port, token=TOKEN[:-1] + "N")
        wrong.send(frame(STEP, pb.StepRequest(step_id=1).SerializeToString()))  # pipelined
        assert wrong.end().code == "UNAUTHENTICATED"
        wrong.close()
        _assert_serving(ex)  # the right token in the hello, the metadata on gRPC
    finally:
        ex.stop()


def test_wrong_magic_is_closed_without_a_reply(executor):
    sock = SocketStepStream(executor.step_port, hello=False)
    sock.send(b"GET / HTTP/1.1\r\nHost: executor\r\n\r\n")
    assert sock.closed(within=2)
    sock.close()
    _assert_serving(executor)


def test_oversized_hello_costs_nothing(executor):
    sock = SocketStepStream(executor.step_port, hello=False)
    with PeakRSS(executor.proc.pid, interval=0.02) as rss:
        sock.send(MAGIC + HEADER.pack(2**32 - 1, HELLO))  # a 4 GiB hello
        started = time.monotonic()
        assert sock.closed(within=2)
        assert time.monotonic() - started < 1
        time.sleep(0.3)
    assert rss.peak - rss.base < RSS_SLACK_MIB, (rss.base, rss.peak)
    sock.close()
    _assert_serving(executor)


def test_oversized_step_costs_nothing(executor):
    sock = SocketStepStream(executor.step_port)
    assert sock.step().step_id == 1
    with PeakRSS(executor.proc.pid, interval=0.02) as rss:
        sock.send(HEADER.pack(MAX_STEP_BYTES + 1, STEP))
        end = sock.end()
        time.sleep(0.3)
    assert end.code == "INVALID_ARGUMENT" and "over its" in end.details
    assert rss.peak - rss.base < RSS_SLACK_MIB, (rss.base, rss.peak)
    sock.close()
    _assert_serving(executor)


@pytest.mark.parametrize(
    "data",
    [
        frame(STEP, b"\x12\x05ab"),  # a new request of 5 bytes, 2 sent: not a StepRequest
        frame(RESULT, pb.StepResult(step_id=1).SerializeToString()),  # not a controller's
        frame(HELLO, pb.StepSocketHello().SerializeToString()),  # a second hello
    ],
    ids=["unparsable-step", "result-frame", "second-hello"],
)
def test_bad_frame_ends_the_stream(executor, data):
    sock = SocketStepStream(executor.step_port)
    assert sock.step().step_id == 1
    sock.send(data)
    assert sock.end().code == "INVALID_ARGUMENT"
    sock.close()
    _assert_serving(executor)


def test_connections_over_the_cap_are_closed_at_once(executor):
    time.sleep(0.5)  # the earlier tests' connections are closed on the executor's side too
    idle = [SocketStepStream(executor.step_port, hello=False) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.3)  # all accepted
        extra = [SocketStepStream(executor.step_port, hello=False) for _ in range(3)]
        for sock in extra:
            assert sock.closed(within=2)
            sock.close()
        assert not any(sock.closed(within=0.05) for sock in idle)  # the first 8 are served
    finally:
        for sock in idle:
            sock.close()
    wait_until(lambda: _one_step(executor.step_port), 5, "a connection under the cap")
    _assert_serving(executor)


def test_a_silent_client_is_closed_after_the_hello_timeout(executor):
    silent = SocketStepStream(executor.step_port, hello=False)
    started = time.monotonic()
    assert silent.closed(within=15)
    assert 9 < time.monotonic() - started < 12
    silent.close()
    _assert_serving(executor)


def test_a_slow_hello_is_closed_by_the_hello_timeout(executor):
    """The magic and hello must arrive within the timeout in all, not each byte within it:
    else a client sending a byte every few seconds holds one of the 8 connections for hours."""
    slow = SocketStepStream(executor.step_port, hello=False)
    hello = MAGIC + frame(HELLO, pb.StepSocketHello().SerializeToString())
    stop = threading.Event()

    def dribble():  # a byte every 2 s: each read is quick, the hello never ends in time
        for byte in hello:
            if stop.wait(2):
                return
            try:
                slow.send(bytes([byte]))
            except OSError:
                return

    threading.Thread(target=dribble, daemon=True).start()
    try:
        assert slow.closed(within=12), "a hello sent a byte at a time is still open after 12 s"
    finally:
        stop.set()
        slow.close()
    _assert_serving(executor)


def test_a_client_gone_mid_stream_leaves_the_executor_serving(executor, default_model_dir):
    prompt = _prompt(default_model_dir)
    sock = SocketStepStream(executor.step_port)
    new = pb.NewRequest(request_id="gone", prompt_token_ids=prompt, block_ids=[1, 2])
    new.num_scheduled_tokens = len(prompt)
    assert sock.step(pb.StepRequest(new_requests=[new])).step_id == 1
    half = frame(STEP, pb.StepRequest(step_id=2, finished_request_ids=["gone"]).SerializeToString())
    sock.send(half[: len(half) // 2])  # the controller dies in the middle of a frame
    sock.close()
    _assert_serving(executor)
    block_size = executor.info.kv_cache.block_size
    stream = GrpcStepStream(executor.stub, executor.metadata)
    over_grpc = _generate(stream.step, "after-grpc", prompt, block_size)
    stream.close()
    sock = SocketStepStream(executor.step_port)
    assert _generate(sock.step, "after-socket", prompt, block_size) == over_grpc
    sock.close()
