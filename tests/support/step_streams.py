"""Step streams driven one step at a time, for tests against a real executor: over gRPC
(ExecuteModel) and over the executor's step socket (common/host/step_socket.py)."""

from __future__ import annotations

import queue
import socket

from common.wire.pb import executor_pb2 as pb
from common.wire.pb import executor_pb2_grpc as pb_grpc
from common.wire.step_frames import END, HEADER, HELLO, MAGIC, RESULT, STEP, frame


class StreamEnded(Exception):
    """The executor ended a socket stream with this END frame."""

    def __init__(self, end: pb.StepSocketEnd):
        super().__init__(f"{end.code}: {end.details}")
        self.code, self.details = end.code, end.details


class GrpcStepStream:
    """An ExecuteModel call driven one step at a time (step ids from 1)."""

    def __init__(self, stub: pb_grpc.ExecutorStub, metadata: tuple | None = None):
        self._requests: queue.Queue = queue.Queue()
        self._responses = stub.ExecuteModel(
            iter(self._requests.get, None), timeout=120, metadata=metadata
        )
        self._step = 0

    def step(self, req: pb.StepRequest | None = None) -> pb.StepResult:
        self._step += 1
        req = req or pb.StepRequest()
        req.step_id = self._step
        self._requests.put(req)
        result = next(self._responses)
        assert result.step_id == self._step
        return result

    def close(self) -> None:
        self._requests.put(None)
        self._responses.cancel()


class SocketStepStream:
    """A blocking step-socket client: MAGIC and the HELLO frame (unless `hello` is False), then
    STEP frames, each answered by a RESULT frame (or the stream's END)."""

    def __init__(self, port: int, token: str = "", generation: int = 0, hello: bool = True):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=20)
        self._step = 0
        if hello:
            msg = pb.StepSocketHello(token=token, generation=generation)
            self.send(MAGIC + frame(HELLO, msg.SerializeToString()))

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def read_frame(self) -> tuple[int, bytes]:
        """The next frame's (kind, payload); AssertionError if the connection closed."""
        header = self.sock.recv(HEADER.size, socket.MSG_WAITALL)
        assert len(header) == HEADER.size, "the executor closed the step socket"
        length, kind = HEADER.unpack(header)
        payload = self.sock.recv(length, socket.MSG_WAITALL) if length else b""
        assert len(payload) == length, "the executor closed the step socket in a frame"
        return kind, payload

    def step(self, req: pb.StepRequest | None = None) -> pb.StepResult:
        """Run one step: its result, or StreamEnded when the executor ends the stream."""
        self._step += 1
        req = req or pb.StepRequest()
        req.step_id = self._step
        self.send(frame(STEP, req.SerializeToString()))
        kind, payload = self.read_frame()
        if kind == END:
            raise StreamEnded(pb.StepSocketEnd.FromString(payload))
        assert kind == RESULT
        result = pb.StepResult.FromString(payload)
        assert result.step_id == self._step
        return result

    def end(self) -> pb.StepSocketEnd:
        """The END frame that must come next, after which the executor closes."""
        kind, payload = self.read_frame()
        assert kind == END, f"frame kind {kind}, not END"
        assert self.closed(within=5), "still open after END"
        return pb.StepSocketEnd.FromString(payload)

    def closed(self, within: float) -> bool:
        """Whether the executor closes the connection, sending nothing, within `within` s."""
        self.sock.settimeout(within)
        try:
            return self.sock.recv(1) == b""
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False
        finally:
            self.sock.settimeout(20)

    def close(self) -> None:
        self.sock.close()
