"""The controller's gRPC client for one executor: handshake and the step stream."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.wire import convert
from common.wire.config import DeviceInfo, MemoryProfile
from common.wire.ownership import SESSION_METADATA
from common.wire.pb import executor_pb2 as pb
from common.wire.pb import executor_pb2_grpc as pb_grpc
from common.wire.step_types import StepInput, StepOutput
from controller.fleet.channel_security import ChannelSecurity
from controller.fleet.ownership import refusal
from controller.fleet.step_socket import StepSocket, StepSocketError, split_address

log = logging.getLogger(__name__)

# No keepalive pings: the health checks watch the connection, and an executor's gRPC server
# answers frequent pings during a long call (a warm-up that compiles for minutes) with GOAWAY
# "too_many_pings", which would break the call.
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
    ("grpc.max_send_message_length", 256 * 1024 * 1024),
]


class ExecutorLost(RuntimeError):
    """The executor's stream broke, it restarted, or it stopped answering in time."""


class OwnedElsewhere(ExecutorLost):
    """InitDevice was refused: another controller's lease on the executor lives."""

    def __init__(self, owner: str, seconds_left: float, details: str):
        super().__init__(details)
        self.owner = owner  # the owner id holding the executor
        self.seconds_left = seconds_left  # until its lease expires, unless renewed


class LeaseLost(ExecutorLost):
    """The executor refused to renew this controller's session: another owner took it, or it
    was released."""


class StepNotSendable(ValueError):
    """A step that cannot be converted to its wire form: nothing was sent, the stream and the
    executor are fine (a request's data is at fault, see convert.step_wire_problems)."""


def grpc_status_of(exc: BaseException | None) -> str:
    """The gRPC status code name behind a failure (its cause chain), or "" if none."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
            return exc.code().name
        if isinstance(exc, StepSocketError):
            return exc.code
        exc = exc.__cause__ or exc.__context__
    return ""


@dataclass
class HandshakeResult:
    """What the startup handshake established."""

    info: DeviceInfo  # InitDevice's answer
    memory: MemoryProfile  # ProfileMemory's answer
    num_blocks: int  # KV blocks allocated on the executor (block 0 is the null block)
    warmup_seconds: float  # InitializeCache's warm-up time


class ExecutorClient:
    """gRPC channel, handshake and ExecuteModel stream to one executor."""

    def __init__(
        self,
        address: str,
        step_timeout: float = 300.0,
        security: ChannelSecurity | None = None,
        owner_id: str = "",
        lease_seconds: float = 0.0,
    ):
        self.address = address  # host:port
        self.step_timeout = step_timeout  # seconds a step may take before the executor is lost
        self.security = security or ChannelSecurity()  # TLS and token of every call
        self.owner_id = owner_id  # this controller's owner id ("" = ownerless sessions)
        self.lease_seconds = lease_seconds  # the lease asked for (0 = the executor's default)
        self.generation = 0  # the session InitDevice granted (0: none, or an older executor)
        self.granted_seconds = 0.0  # the lease granted (0: none to renew)
        # The executor reads packed steps (its Capabilities.packed_steps, set at each
        # handshake); False until then: every executor reads the per-request messages.
        self.packed_steps = False
        # The executor's step socket port (its Capabilities.step_socket_port, set at each
        # handshake; 0: steps go over ExecuteModel). Reset to 0 when it cannot be reached.
        self.step_port = 0
        self._channel: grpc.aio.Channel | None = None  # opened in the serving event loop
        self._call = None  # the open ExecuteModel stream
        self._socket: StepSocket | None = None  # the open step socket

    @property
    def channel(self) -> grpc.aio.Channel:
        if self._channel is None:
            sec = self.security
            if sec.credentials is None:
                self._channel = grpc.aio.insecure_channel(self.address, options=_CHANNEL_OPTIONS)
            else:
                options = list(_CHANNEL_OPTIONS)
                if sec.server_name:
                    options.append(("grpc.ssl_target_name_override", sec.server_name))
                self._channel = grpc.aio.secure_channel(
                    self.address, sec.credentials, options=options
                )
            self._stub = pb_grpc.ExecutorStub(self._channel)
            self._health = health_pb2_grpc.HealthStub(self._channel)
        return self._channel

    async def check_health(self, timeout: float) -> str:
        """One grpc.health.v1 check: "SERVING", "NOT_SERVING", ... or "UNREACHABLE"."""
        _ = self.channel
        try:
            resp = await self._health.Check(
                health_pb2.HealthCheckRequest(service=""),
                timeout=timeout,
                metadata=self.security.metadata,
            )
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, TimeoutError):
            return "UNREACHABLE"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    async def identify(self, timeout: float) -> str:
        """The executor's incarnation id, without touching its state; "" when it does not
        say (an executor of a version without Identify)."""
        _ = self.channel
        try:
            resp = await self._stub.Identify(
                pb.IdentifyRequest(), timeout=timeout, metadata=self.security.metadata
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                return ""
            raise
        return resp.incarnation_id

    async def handshake(
        self,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        seed: int,
        num_blocks_override: int = 0,
        kind_limits: dict[str, tuple[int, int]] | None = None,
        timeout: float = 900.0,
    ) -> HandshakeResult:
        """InitDevice -> ProfileMemory -> InitializeCache, sizing the cache from the KV spec.

        `kind_limits` maps a device kind to its own (max_num_batched_tokens, max_num_seqs):
        when the executor's kind has an entry, InitDevice is sent again with those limits.
        Every call may take up to `timeout` seconds: the warm-up may compile for minutes, and
        an executor serializes device calls, so a call may wait behind an earlier warm-up
        (retrying sooner would only queue more handshakes behind it).
        """
        await self.close_stream()
        _ = self.channel

        async def init_device(tokens: int, seqs: int) -> DeviceInfo:
            req = pb.InitDeviceRequest(
                max_num_batched_tokens=tokens,
                max_num_seqs=seqs,
                max_model_len=max_model_len,
                seed=seed,
                owner_id=self.owner_id,
                lease_seconds=self.lease_seconds,
            )
            self.generation, self.granted_seconds = 0, 0.0
            resp = await self._init_device(req, timeout)
            self.generation, self.granted_seconds = resp.generation, resp.lease_seconds
            return convert.device_info_from_pb(resp)

        info = await init_device(max_num_batched_tokens, max_num_seqs)
        override = (kind_limits or {}).get(info.device_kind)
        if override and override != (max_num_batched_tokens, max_num_seqs):
            info = await init_device(*override)
        meta = self.session_metadata
        memory = convert.memory_profile_from_pb(
            await self._stub.ProfileMemory(
                pb.ProfileMemoryRequest(), timeout=timeout, metadata=meta
            )
        )
        num_blocks = memory.available_kv_bytes // info.kv_cache.bytes_per_block
        if num_blocks_override > 0:
            num_blocks = num_blocks_override
        if num_blocks < 2:
            raise RuntimeError(
                f"executor {self.address}: {memory.available_kv_bytes} bytes hold no KV block "
                f"of {info.kv_cache.bytes_per_block} bytes"
            )
        resp = await self._stub.InitializeCache(
            pb.InitializeCacheRequest(num_blocks=num_blocks), timeout=timeout, metadata=meta
        )
        return HandshakeResult(info, memory, num_blocks, resp.warmup_seconds)

    async def _init_device(self, req: pb.InitDeviceRequest, timeout: float):
        """InitDevice; OwnedElsewhere when another controller's lease holds the executor."""
        try:
            return await self._stub.InitDevice(
                req, timeout=timeout, metadata=self.security.metadata
            )
        except grpc.aio.AioRpcError as exc:
            refused = refusal(exc)
            if refused is None:
                raise
            raise OwnedElsewhere(*refused, exc.details() or "") from exc

    @property
    def session_metadata(self) -> tuple:
        """The metadata of the session's calls: the token, and the generation (fencing)."""
        if not self.generation:
            return self.security.metadata
        return (*self.security.metadata, (SESSION_METADATA, str(self.generation)))

    async def renew_lease(self, timeout: float) -> float:
        """Renew the session's lease; the lease's length. LeaseLost when the executor says the
        session is no longer its own; other gRPC errors are raised as they are."""
        try:
            resp = await self._stub.RenewLease(
                pb.LeaseRequest(owner_id=self.owner_id, generation=self.generation),
                timeout=timeout,
                metadata=self.security.metadata,
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise LeaseLost(f"lease lost: {exc.details()}") from exc
            raise
        return resp.lease_seconds

    async def release_session(self, timeout: float) -> bool:
        """Release the session (another controller may take the executor at once); whether
        the executor took the release. Never raises: the lease expires anyway."""
        if not self.generation or self._channel is None:
            return False
        generation, self.generation = self.generation, 0
        try:
            await self._stub.ReleaseSession(
                pb.LeaseRequest(owner_id=self.owner_id, generation=generation),
                timeout=timeout,
                metadata=self.security.metadata,
            )
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as exc:
            log.info("executor %s: release of session %d failed: %s", self.address, generation, exc)
            return False
        log.info("executor %s: session %d released", self.address, generation)
        return True

    async def step(self, step: StepInput) -> StepOutput:
        """Send one step on the stream and wait for its result."""
        await self.send_step(step)
        return await self.receive_result(step)

    async def send_step(self, step: StepInput) -> None:
        """Send one step on the stream (opened on first use); results come back in order.
        StepNotSendable, before anything is sent, when the step cannot be converted."""
        try:
            msg = convert.step_to_pb(step, self.packed_steps)
        except convert.CONVERSION_ERRORS as exc:
            raise StepNotSendable(f"step {step.step_id}: {exc!r}") from exc
        if self.step_port and self._call is None:
            try:
                if self._socket is None:
                    self._socket = await self._open_socket()
                if self._socket is not None:
                    self._socket.send(msg.SerializeToString())
                    return
            except OSError as exc:
                await self.close_stream()
                raise ExecutorLost(f"step socket broke: {exc!r}") from exc
        try:
            if self._call is None:
                self._call = self._stub.ExecuteModel(metadata=self.session_metadata)
            await self._call.write(msg)
        except grpc.aio.AioRpcError as exc:
            await self.close_stream()
            raise ExecutorLost(f"step stream broke: {exc.code().name}: {exc.details()}") from exc
        except grpc.aio.UsageError as exc:
            await self.close_stream()
            raise ExecutorLost(f"step stream unusable: {exc}") from exc

    @property
    def step_transport(self) -> str:
        """How the open step stream goes: "socket", "grpc", or "" when none is open."""
        return "socket" if self._socket is not None else "grpc" if self._call is not None else ""

    async def _open_socket(self) -> StepSocket | None:
        """Connect the executor's step socket; None (and steps over ExecuteModel for the rest
        of the session) when it cannot be reached: a network policy may let the gRPC port
        through alone."""
        host, sec = split_address(self.address), self.security
        try:
            return await StepSocket.open(
                host,
                self.step_port,
                token=sec.token,
                generation=self.generation,
                ssl_context=sec.ssl_context,
                server_hostname=sec.server_name,
            )
        except (OSError, TimeoutError) as exc:
            log.warning(
                "executor %s: its step socket (port %d) cannot be reached (%r); steps go over gRPC",
                self.address,
                self.step_port,
                exc,
            )
            self.step_port = 0
            return None

    async def receive_result(self, step: StepInput) -> StepOutput:
        """The result of `step`, the oldest step sent and not yet answered."""
        if self._socket is not None:
            return await self._receive_socket(step)
        if self._call is None:
            raise ExecutorLost("no step stream open")
        try:
            async with asyncio.timeout(self.step_timeout):  # no task per read (as wait_for)
                msg = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            await self.close_stream()
            raise ExecutorLost(f"step stream broke: {exc.code().name}: {exc.details()}") from exc
        except TimeoutError as exc:
            await self.close_stream()
            raise ExecutorLost(f"step {step.step_id} took over {self.step_timeout:g}s") from exc
        except grpc.aio.UsageError as exc:
            await self.close_stream()
            raise ExecutorLost(f"step stream unusable: {exc}") from exc
        if msg is grpc.aio.EOF:
            await self.close_stream()
            raise ExecutorLost(f"executor {self.address} closed the step stream")
        result = convert.result_from_pb(msg)
        if result.step_id != step.step_id:
            raise ExecutorLost(f"step {step.step_id} answered as {result.step_id}")
        return result

    async def _receive_socket(self, step: StepInput) -> StepOutput:
        """`receive_result` on the step socket."""
        assert self._socket is not None
        try:
            async with asyncio.timeout(self.step_timeout):
                msg = await self._socket.receive()
        except StepSocketError as exc:
            await self.close_stream()
            raise ExecutorLost(f"step stream broke: {exc.code}: {exc.details}") from exc
        except TimeoutError as exc:  # before OSError, of which it is one
            await self.close_stream()
            raise ExecutorLost(f"step {step.step_id} took over {self.step_timeout:g}s") from exc
        except OSError as exc:
            await self.close_stream()
            raise ExecutorLost(f"step socket broke: {exc!r}") from exc
        result = convert.result_from_pb(msg)
        if result.step_id != step.step_id:
            raise ExecutorLost(f"step {step.step_id} answered as {result.step_id}")
        return result

    async def close_stream(self) -> None:
        """End the step stream, if open."""
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        if self._call is not None:
            self._call.cancel()
            self._call = None

    async def close(self) -> None:
        """Close the stream and the channel; the next call opens a fresh channel."""
        await self.close_stream()
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
