"""The Executor gRPC servicer, written once against WorkerBase.

Thin by design: protobuf in, domain objects to the worker, protobuf out. One controller session
at a time: InitDevice starts a new session (resetting request state) for its owner, under a
lease (common.host.lease), and every ExecuteModel stream replaces the one before it. A replaced
stream runs no further step: its next request ends it with ABORTED (FAILED_PRECONDITION when
another owner took the executor: that owner's InitDevice also ends it at once), so two
controllers never drive the device at once. A session's calls carry its generation in the
metadata (SESSION_METADATA); a stale one is refused with FAILED_PRECONDITION (fencing).

Failures stay as small as their cause (common.host.device_errors): a request the runner cannot
run fails alone (its error in the step's result); a step that fails as a whole for another
reason fails its requests, which the executor forgets, and the stream goes on; a device failure
(or ``max_failed_steps`` whole-step failures in a row) marks the executor failed: every call
then ends UNAVAILABLE, and ``on_device_failed`` turns its health to NOT_SERVING.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from common.host.device_errors import is_fatal_device_error
from common.host.lease import LeaseHeld, LeaseLost, SessionLease
from common.host.request_log import log_failed_requests, log_step_requests
from common.host.step_pipeline import (
    OverlapCounts,
    StepsAhead,
    decoded_ahead,
    run_ahead,
    run_overlapped,
)
from common.host.worker_base import WorkerBase
from common.wire import convert
from common.wire.ownership import OWNER_TRAILER, SECONDS_LEFT_TRAILER, SESSION_METADATA
from common.wire.pb import executor_pb2 as pb
from common.wire.pb import executor_pb2_grpc as pb_grpc
from common.wire.step_types import RequestStepOutput, StepInput, StepOutput

log = logging.getLogger(__name__)


class ExecutorServicer(pb_grpc.ExecutorServicer):
    """Serves one worker; device calls are serialized by a lock."""

    def __init__(
        self,
        worker: WorkerBase,
        max_failed_steps: int = 3,
        on_device_failed: Callable[[str], None] | None = None,
        lease: SessionLease | None = None,
    ):
        self.worker = worker  # the device worker
        self.max_failed_steps = max(max_failed_steps, 1)  # whole-step failures in a row that
        # mean the device is failing
        self.on_device_failed = on_device_failed  # told once when the device failed
        self._failed_steps = 0  # whole-step failures in a row
        self._lock = threading.Lock()  # one device call at a time
        self.lease = lease or SessionLease()  # the session's owner, lease and generation
        self._stream = 0  # bumped by every ExecuteModel; older streams end
        self._open: dict[int, tuple[int, str, object]] = {}  # open streams: stream ->
        # (generation, owner, gRPC context), to end them when another owner takes over
        self._streams_open = 0  # ExecuteModel calls in progress
        self._state = threading.Condition()  # guards the stream counters
        self.step_socket_port = 0  # the step socket's port, told to controllers (0: none)

    def load(self) -> None:
        """Bind the device and load the weights (at startup, before reporting SERVING)."""
        with self._lock:
            self._ensure_loaded()

    @property
    def device_failure(self) -> str:
        """Why the device failed ("" while it serves)."""
        return self.worker.device_failure

    def _device_failed(self, reason: str) -> None:
        """Take no more work: every call ends UNAVAILABLE from now on; health goes
        NOT_SERVING (``on_device_failed``)."""
        if self.worker.device_failure:
            return
        self.worker.device_failure = reason[:500]
        log.critical("device failed: %s; the executor takes no more work", reason)
        if self.on_device_failed is not None:
            self.on_device_failed(reason)

    def _check_device(self, context) -> None:
        """End the call UNAVAILABLE if the device failed."""
        if self.worker.device_failure:
            context.abort(
                grpc.StatusCode.UNAVAILABLE, f"device failed: {self.worker.device_failure}"
            )

    def _device_call(self, call: Callable, context):
        """``call()`` under the device lock; a device error on the way fails the device."""
        self._check_device(context)
        with self._lock:
            try:
                return call()
            except Exception as exc:
                if is_fatal_device_error(exc):
                    self._device_failed(repr(exc))
                    context.abort(grpc.StatusCode.UNAVAILABLE, f"device failed: {exc!r}")
                raise

    def _ensure_loaded(self) -> None:
        if self.worker.model_runner is None:
            self.worker.init_device()
        self.worker.load_model()

    def InitDevice(self, request: pb.InitDeviceRequest, context) -> pb.InitDeviceResponse:
        self._check_device(context)
        try:
            grant = self.lease.grant(request.owner_id, request.lease_seconds)
        except LeaseHeld as exc:
            level = logging.DEBUG if exc.repeated else logging.WARNING  # it retries every few s
            log.log(
                level, "InitDevice from %r (%s) refused: %s", request.owner_id, context.peer(), exc
            )
            context.set_trailing_metadata(
                ((OWNER_TRAILER, exc.owner), (SECONDS_LEFT_TRAILER, f"{exc.seconds_left:.3f}"))
            )
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        self._end_other_owners(request.owner_id)

        def init():
            self._fence(grant.generation, context)
            self._ensure_loaded()
            self.worker.configure(
                request.max_num_batched_tokens, request.max_num_seqs, request.max_model_len
            )
            self.worker.reset()
            self._failed_steps = 0
            return self.worker.describe()

        with self.lease.hold(grant.generation):
            info = self._device_call(init, context)
        log.info(
            "session %d: InitDevice from %r at %s (lease %.1fs; %s %s, incarnation %s)",
            grant.generation,
            request.owner_id,
            context.peer(),
            grant.lease_seconds,
            info.device_kind,
            info.device_name,
            info.incarnation_id[:8],
        )
        resp = convert.device_info_to_pb(info)
        resp.generation, resp.lease_seconds = grant.generation, grant.lease_seconds
        resp.capabilities.step_socket_port = self.step_socket_port
        return resp

    def RenewLease(self, request: pb.LeaseRequest, context) -> pb.LeaseResponse:
        """Keep the owner's lease alive (FAILED_PRECONDITION once its session is not current)."""
        try:
            seconds = self.lease.renew(request.owner_id, request.generation)
        except LeaseLost as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return pb.LeaseResponse(lease_seconds=seconds)

    def ReleaseSession(self, request: pb.LeaseRequest, context) -> pb.LeaseResponse:
        """End the owner's session now; its open stream ends at its next step."""
        try:
            self.lease.release(request.owner_id, request.generation)
        except LeaseLost as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        log.info("session %d: released by %r", request.generation, request.owner_id)
        return pb.LeaseResponse(lease_seconds=0.0)

    def _session_of(self, context) -> int:
        """The generation of the session a call belongs to (from its metadata); the call ends
        FAILED_PRECONDITION when it is stale or, without one, the executor has an owner."""
        named = None
        for key, value in context.invocation_metadata() or ():
            if key == SESSION_METADATA:
                try:
                    named = int(value)
                except ValueError:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad {SESSION_METADATA}")
        try:
            return self.lease.session_of(named)
        except LeaseLost as exc:
            log.warning("call from %s refused: %s", context.peer(), exc)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))

    def _fence(self, generation: int, context) -> None:
        """End the call FAILED_PRECONDITION if its session is no longer the current one."""
        reason = self.lease.stale(generation)
        if reason:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, reason)

    def _end_other_owners(self, owner: str) -> None:
        """Another owner took the executor: end the open streams of earlier owners now (their
        clients see CANCELLED) instead of at their next step, which may never come."""
        with self._state:
            ended = [ctx for _, o, ctx in self._open.values() if o != owner]
        for ctx in ended:
            ctx.cancel()
        if ended:
            log.warning(
                "%d step streams of an earlier owner ended (taken by %r)", len(ended), owner
            )

    def Identify(self, request, context) -> pb.IdentifyResponse:
        """The incarnation id, without the device lock (a warm-up may hold it for minutes)."""
        return pb.IdentifyResponse(incarnation_id=self.worker.incarnation_id)

    def ProfileMemory(self, request, context) -> pb.ProfileMemoryResponse:
        generation = self._session_of(context)

        def profile_memory():
            self._fence(generation, context)
            self._ensure_loaded()
            return self.worker.determine_available_memory()

        with self.lease.hold(generation):
            profile = self._device_call(profile_memory, context)
        log.info("profiled: %.1f MiB for the KV cache", profile.available_kv_bytes / 2**20)
        return convert.memory_profile_to_pb(profile)

    def InitializeCache(self, request: pb.InitializeCacheRequest, context):
        if request.num_blocks < 2:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "num_blocks must be at least 2")

        generation = self._session_of(context)

        def initialize():
            self._fence(generation, context)
            self._ensure_loaded()
            return self.worker.initialize_cache(request.num_blocks)

        with self.lease.hold(generation):
            seconds, graphs = self._device_call(initialize, context)
        log.info("cache: %d blocks; warm-up %.2fs, %d graphs", request.num_blocks, seconds, graphs)
        return pb.InitializeCacheResponse(warmup_seconds=seconds, num_compiled_graphs=graphs)

    @property
    def streams_open(self) -> int:
        """ExecuteModel streams in progress (a replaced one counts until it ends)."""
        return self._streams_open

    def wait_streams_closed(self, timeout: float) -> bool:
        """Wait until no step stream is open; False if one still is after `timeout`."""
        with self._state:
            return self._state.wait_for(lambda: self._streams_open == 0, timeout)

    def _replaced(self, session: int, stream: int, owner: str) -> tuple[grpc.StatusCode, str]:
        """Why the stream may not run a step (a status and "" when it may)."""
        generation, current, _ = self.lease.state()
        if session != generation and owner != current:
            return grpc.StatusCode.FAILED_PRECONDITION, f"fenced: {self.lease.stale(session)}"
        if session != generation:
            return grpc.StatusCode.ABORTED, "replaced by a newer controller session (InitDevice)"
        if stream != self._stream:
            return grpc.StatusCode.ABORTED, "replaced by a newer step stream (ExecuteModel)"
        return grpc.StatusCode.OK, ""

    def ExecuteModel(self, request_iterator, context):
        self._check_device(context)
        session = self._session_of(context)
        if not self.worker.cache_initialized:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "InitializeCache first")
        with self._state:
            self._stream += 1
            stream, owner = self._stream, self.lease.owner
            if self._streams_open:
                log.warning(
                    "session %d: a new step stream from %s replaces the open one",
                    session,
                    context.peer(),
                )
            self._streams_open += 1
            self._open[stream] = (session, owner, context)
        log.info("session %d: step stream %d opened by %s", session, stream, context.peer())
        try:
            yield from self._steps(request_iterator, context, session, stream, owner)
        finally:
            with self._state:
                self._streams_open -= 1
                self._open.pop(stream, None)
                self._state.notify_all()
            log.info("session %d: step stream %d closed", session, stream)

    def _steps(self, request_iterator, context, session: int, stream: int, owner: str):
        def execute(step: StepInput) -> tuple[StepInput, StepOutput]:
            return self._finish(self._launch(step, session, stream, owner))

        def launch(step: StepInput) -> _Launched:
            return self._launch(step, session, stream, owner)

        counts = None
        if self.worker.overlaps_steps:
            counts = OverlapCounts()
            outputs = run_overlapped(
                StepsAhead(request_iterator),
                launch,
                self._finish,
                self.worker.step_needs_results,
                self._launched_done,
                counts,
            )
        elif self.worker.decode_steps_ahead:
            outputs = run_ahead(decoded_ahead(request_iterator), execute)
        else:
            outputs = (execute(convert.step_from_pb(r)) for r in request_iterator)
        try:
            for step, output in outputs:
                yield convert.result_to_pb(output, step)  # packed: a token per request
        except _StepAborted as exc:
            context.abort(exc.code, exc.details)
        finally:
            if counts is not None:
                log.info(
                    "step stream %d: %d of %d steps launched while another was in flight",
                    stream,
                    counts.overlapped,
                    counts.launched,
                )

    def _execute(self, step: StepInput, session: int, stream: int, owner: str = "") -> StepOutput:
        """Run one step on the worker, unless the stream was replaced or its session (of
        `owner`) fenced (_StepAborted)."""
        return self._finish(self._launch(step, session, stream, owner))[1]

    def _launch(self, step: StepInput, session: int, stream: int, owner: str) -> _Launched:
        """Start a step on the worker (see ``_execute``); a launch that raises is the step's
        failure (``_step_failed``)."""
        started = time.perf_counter()
        with self._lock:
            code, replaced = self._replaced(session, stream, owner)
            if replaced:
                log.warning("session %d: step stream %d ends: %s", session, stream, replaced)
                raise _StepAborted(code, replaced)
            if self.worker.device_failure:
                raise _StepAborted(
                    grpc.StatusCode.UNAVAILABLE, f"device failed: {self.worker.device_failure}"
                )
            log_step_requests(step)
            try:
                return _Launched(step, started, self.worker.launch_step(step))
            except Exception as exc:
                return _Launched(step, started, None, self._step_failed(step, exc))

    def _launched_done(self, launched: _Launched) -> bool:
        """Whether a launched step's device work is done (finishing it would not wait)."""
        return launched.output is not None or self.worker.step_done(launched.handle)

    def _finish(self, launched: _Launched) -> tuple[StepInput, StepOutput]:
        """The output of a launched step, once its device work is done (a failure there is
        the step's, as in ``_launch``)."""
        step, output = launched.step, launched.output
        if output is None:
            with self._lock:
                try:
                    output = self.worker.finish_step(launched.handle)
                    self._failed_steps = 0
                except Exception as exc:
                    output = self._step_failed(step, exc)
        if not output.device_seconds:
            output.device_seconds = time.perf_counter() - launched.started
        log_failed_requests(output)
        return step, output

    def _step_failed(self, step: StepInput, exc: Exception) -> StepOutput:
        """A step that raised: a device failure ends the stream (and the executor's service);
        anything else fails the step's requests alone, forgotten by the runner (their state is
        not trusted), until ``max_failed_steps`` such steps in a row mean the device fails."""
        self._failed_steps += 1
        fatal = is_fatal_device_error(exc)
        if fatal or self._failed_steps >= self.max_failed_steps:
            log.error("step %d failed", step.step_id, exc_info=exc)
            reason = repr(exc) if fatal else f"{self._failed_steps} steps in a row failed: {exc!r}"
            self._device_failed(reason)
            raise _StepAborted(grpc.StatusCode.UNAVAILABLE, f"device failed: {reason}") from exc
        log.error("step %d failed; its requests fail", step.step_id, exc_info=exc)
        ids = list(dict.fromkeys(r.request_id for r in [*step.new_requests, *step.cached_requests]))
        if self.worker.model_runner is not None:
            self.worker.model_runner.forget(ids)
        error = f"the step failed on the executor: {exc!r}"[:500]
        return StepOutput(step.step_id, [RequestStepOutput(rid, error=error) for rid in ids])


@dataclass
class _Launched:
    """A step the servicer launched on the worker."""

    step: StepInput  # the step
    started: float  # perf_counter() at its launch
    handle: object  # what the worker's finish_step takes (None when the launch failed)
    output: StepOutput | None = None  # its output, when known at launch (a failed launch)


class _StepAborted(Exception):
    """A step the stream must end on, with this status."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details
