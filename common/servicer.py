"""The Executor gRPC servicer, written once against WorkerBase.

Thin by design: protobuf in, domain objects to the worker, protobuf out. One controller session
at a time: InitDevice starts a new session (resetting request state) and ends any ExecuteModel
stream of the previous one.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc

from common import convert
from common.pb import executor_pb2 as pb
from common.pb import executor_pb2_grpc as pb_grpc
from common.worker_base import WorkerBase

log = logging.getLogger(__name__)


class ExecutorServicer(pb_grpc.ExecutorServicer):
    """Serves one worker; device calls are serialized by a lock."""

    def __init__(self, worker: WorkerBase):
        self.worker = worker  # the device worker
        self._lock = threading.Lock()  # one device call at a time
        self._session = 0  # bumped by every InitDevice; older streams end

    def load(self) -> None:
        """Bind the device and load the weights (at startup, before reporting SERVING)."""
        with self._lock:
            self._ensure_loaded()

    def _ensure_loaded(self) -> None:
        if self.worker.model_runner is None:
            self.worker.init_device()
        self.worker.load_model()

    def InitDevice(self, request: pb.InitDeviceRequest, context) -> pb.InitDeviceResponse:
        with self._lock:
            self._session += 1
            self._ensure_loaded()
            self.worker.configure(
                request.max_num_batched_tokens, request.max_num_seqs, request.max_model_len
            )
            self.worker.reset()
            info = self.worker.describe()
        log.info(
            "session %d: InitDevice from %s (%s %s, incarnation %s)",
            self._session, context.peer(), info.device_kind, info.device_name,
            info.incarnation_id[:8],
        )
        return convert.device_info_to_pb(info)

    def ProfileMemory(self, request, context) -> pb.ProfileMemoryResponse:
        with self._lock:
            self._ensure_loaded()
            profile = self.worker.determine_available_memory()
        log.info("profiled: %.1f MiB for the KV cache", profile.available_kv_bytes / 2**20)
        return convert.memory_profile_to_pb(profile)

    def InitializeCache(self, request: pb.InitializeCacheRequest, context):
        if request.num_blocks < 2:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "num_blocks must be at least 2")
        with self._lock:
            self._ensure_loaded()
            seconds, graphs = self.worker.initialize_cache(request.num_blocks)
        log.info(
            "cache: %d blocks; warm-up %.2fs, %d graphs", request.num_blocks, seconds, graphs
        )
        return pb.InitializeCacheResponse(warmup_seconds=seconds, num_compiled_graphs=graphs)

    def ExecuteModel(self, request_iterator, context):
        session = self._session
        if not self.worker.cache_initialized:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "InitializeCache first")
        log.info("session %d: step stream opened by %s", session, context.peer())
        for request in request_iterator:
            if session != self._session:
                context.abort(grpc.StatusCode.ABORTED, "replaced by a newer controller session")
            step = convert.step_from_pb(request)
            started = time.perf_counter()
            with self._lock:
                try:
                    output = self.worker.execute_model(step)
                except Exception as exc:  # the whole step failed: the controller retries
                    log.exception("step %d failed", step.step_id)
                    context.abort(grpc.StatusCode.INTERNAL, f"step {step.step_id} failed: {exc}")
            if not output.device_seconds:
                output.device_seconds = time.perf_counter() - started
            yield convert.result_to_pb(output)
        log.info("session %d: step stream closed", session)
