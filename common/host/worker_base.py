"""WorkerBase: one executor process's worker, driven by the gRPC servicer.

The worker binds the device, owns a model runner and answers the servicer's calls with domain
objects. Common lifecycle logic lives here; device binding, memory accounting and step execution
are virtual and implemented by executor_gpu / executor_tpu.
"""

from __future__ import annotations

import abc
import logging
import time
import uuid

from common.host.metrics import ExecutorMetrics
from common.host.model_runner_base import ModelRunnerBase
from common.host.settings import ExecutorConfig
from common.wire.config import DeviceInfo, KVCacheSpec, MemoryProfile
from common.wire.step_types import StepInput, StepOutput

log = logging.getLogger(__name__)


class WorkerBase(abc.ABC):
    """One executor's worker: device, model runner, cache lifecycle."""

    #: "gpu", "tpu" or "cpu"; subclasses set it in init_device().
    device_kind: str = "cpu"

    def __init__(self, config: ExecutorConfig):
        self.config = config  # executor configuration
        self.incarnation_id = uuid.uuid4().hex  # new on every process start
        self.device_name = "unbound"  # set by init_device()
        self.model_runner: ModelRunnerBase | None = None  # set by init_device()
        self.cache_initialized = False  # True after initialize_cache()
        self.device_failure = ""  # why the device failed (common.host.device_errors); "" = fine
        self._model_max_len = 0  # the checkpoint's own max length, before configure()
        self.metrics = ExecutorMetrics(self)  # step and memory metrics (the metrics port)

    @property
    def decode_steps_ahead(self) -> bool:
        """Whether the servicer decodes the next step's message on a reader thread while this
        one runs: yes where the device computes apart from the host's cores; no where the model
        runs on them (the CPU), whose threads the reader would take (16 streams on a 2-core
        host: ~15% fewer tokens/s with it)."""
        return self.device_kind != "cpu"

    # --- common -------------------------------------------------------------------------

    def load_model(self) -> None:
        """Load the weights through the runner (once)."""
        assert self.model_runner is not None, "init_device() first"
        if self.model_runner.get_model() is None:
            started = time.perf_counter()
            self.model_runner.load_model()
            log.info("model loaded in %.1fs", time.perf_counter() - started)

    def compile_or_warm_up_model(self) -> int:
        """Capture graphs / precompile unless enforce_eager, then reset the seed."""
        assert self.model_runner is not None
        made = 0 if self.config.enforce_eager else self.model_runner.capture_model()
        self.model_runner.set_seed(self.config.seed)
        return made

    def get_model(self):
        """The runner's model."""
        assert self.model_runner is not None
        return self.model_runner.get_model()

    def get_kv_cache_spec(self) -> KVCacheSpec:
        """The runner's KV block spec."""
        assert self.model_runner is not None
        return self.model_runner.get_kv_cache_spec()

    def initialize_cache(self, num_blocks: int) -> tuple[float, int]:
        """Allocate the KV cache, then warm up; return (seconds, graphs compiled)."""
        assert self.model_runner is not None
        self.model_runner.initialize_kv_cache(num_blocks)
        started = time.perf_counter()
        made = self.compile_or_warm_up_model()
        self.cache_initialized = True
        return time.perf_counter() - started, made

    def describe(self) -> DeviceInfo:
        """InitDevice's answer: device, model geometry, KV spec, capabilities."""
        assert self.model_runner is not None
        return DeviceInfo(
            incarnation_id=self.incarnation_id,
            device_kind=self.device_kind,
            device_name=self.device_name,
            model=self.model_runner.geometry,
            kv_cache=self.get_kv_cache_spec(),
            capabilities=self.model_runner.get_capabilities(),
        )

    def configure(self, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> None:
        """Adopt the controller's step limits (0 keeps the executor's own)."""
        assert self.model_runner is not None
        geometry = self.model_runner.geometry
        if self._model_max_len == 0:
            self._model_max_len = geometry.max_model_len
        if max_num_batched_tokens > 0:
            self.config.max_num_batched_tokens = max_num_batched_tokens
        if max_num_seqs > 0:
            self.config.max_num_seqs = max_num_seqs
        limit = self._model_max_len
        if max_model_len > 0:
            limit = min(limit, max_model_len)
        geometry.max_model_len = limit

    def reset(self) -> None:
        """Forget all request state (a controller (re)started its session)."""
        if self.model_runner is not None:
            self.model_runner.reset()

    def profile(self, is_start: bool = True, trace_dir: str = "/tmp/tandem-trace") -> None:
        """Start or stop the runner's profiler; on stop, it writes a trace under ``trace_dir``."""
        assert self.model_runner is not None
        if is_start:
            self.model_runner.start_profile()
        else:
            self.model_runner.stop_profile(f"{trace_dir}-{self.incarnation_id}.json")

    def memory_usage(self) -> dict[str, int]:
        """Bytes by kind for the memory metric: weights, kv_cache, and (subclasses) the
        device's used/total."""
        runner = self.model_runner
        usage = {"weights": getattr(runner, "weights_bytes", 0)}
        caches = getattr(runner, "kv_caches", None) or []
        usage["kv_cache"] = sum(c.numel() * c.element_size() for c in caches)
        return usage

    def check_health(self) -> bool:
        """True while the worker can serve steps (loaded, and its device has not failed)."""
        runner = self.model_runner
        return not self.device_failure and runner is not None and runner.get_model() is not None

    # --- virtual ------------------------------------------------------------------------

    @abc.abstractmethod
    def init_device(self) -> None:
        """Bind the device, set device_name and create self.model_runner."""

    @abc.abstractmethod
    def determine_available_memory(self) -> MemoryProfile:
        """Profile a worst-case step; report the bytes the KV cache may take."""

    @abc.abstractmethod
    def execute_model(self, step: StepInput) -> StepOutput:
        """Run one step."""

    # --- steps in two halves (an asynchronous device) --------------------------------------

    @property
    def overlaps_steps(self) -> bool:
        """Whether the servicer launches the next step before finishing the one in flight
        (``launch_step`` / ``finish_step``); no unless a worker's device computes apart from
        the host and its runner splits steps."""
        return False

    def launch_step(self, step: StepInput) -> object:
        """Start a step; ``finish_step`` gives its output. Here the step runs whole."""
        return self.execute_model(step)

    def finish_step(self, launched: object) -> StepOutput:
        """The output of a step ``launch_step`` started (waiting for its device work)."""
        assert isinstance(launched, StepOutput)
        return launched

    def step_done(self, launched: object) -> bool:
        """Whether a launched step's device work is done (``finish_step`` would not wait)."""
        return True

    def step_needs_results(self, step: StepInput) -> bool:
        """Whether ``step`` must wait for the step in flight to finish before its launch (it
        reads a result of that step on the host)."""
        return False
